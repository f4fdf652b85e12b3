"""EventHub: every open event stream of a gateway process over one blocking Redis read.

One task runs ``XREAD BLOCK`` over the event streams (``P:{C}:out:S``) that any client of
this process follows, plus the replica's own wake stream, and hands each entry to the
subscribers of its session. So Redis connections stay bounded (one blocking connection
plus the shared pool) however many SSE or WebSocket clients are open.

Resume rule: a subscriber starts *after* a cursor (an event's entry id). It is registered
before it reads what is already kept after the cursor (catch-up), and every entry id it
has passed is skipped, so nothing between the catch-up and the shared read is lost or
doubled. A subscriber that falls behind (its buffer is full) drops the buffer and catches
up from Redis again. A cursor older than everything kept yields a ``gap`` first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError
from redis.asyncio import Redis
from redis.exceptions import RedisError, ResponseError

from bus_redis import OutboundMessage
from bus_redis.codec import fields, text
from bus_redis.keys import Keys

log = logging.getLogger(__name__)
BUFFER_MAX = 256  # entries buffered per subscriber before it re-reads from Redis instead


class TooManyStreamsError(Exception):
    """The process follows ``max_streams`` event streams already."""


def id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    try:
        return int(ms), int(seq or 0)
    except ValueError:
        return 0, 0


@dataclass(slots=True)
class HubEvent:
    """One event of a session (``gap``: events after ``entry_id`` may be gone)."""

    kind: str  # "event" | "gap"
    entry_id: str
    event: OutboundMessage | None = None


@dataclass(eq=False)
class Subscription:
    hub: EventHub
    stream: str
    cursor: str
    gap: bool = False
    buffer: deque[HubEvent] = field(default_factory=deque)
    catch_up: bool = True
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    def push(self, ev: HubEvent) -> None:
        if len(self.buffer) >= BUFFER_MAX:  # a slow reader: read again from Redis instead
            self.buffer.clear()
            self.catch_up = True
        else:
            self.buffer.append(ev)
        self.wake.set()

    async def events(self, keepalive_s: float) -> AsyncIterator[HubEvent | None]:
        """Events after the cursor, in order, forever; ``None`` every ``keepalive_s``
        without one (for keep-alive comments)."""
        if self.gap:
            yield HubEvent("gap", self.cursor)
        while True:
            if self.catch_up:
                self.catch_up = False
                self.buffer.clear()
                for ev in await self.hub.read_after(self.stream, self.cursor):
                    self.cursor = ev.entry_id
                    yield ev
                    self.catch_up = True  # read on until nothing is left
                continue
            if not self.buffer:
                self.wake.clear()
                try:
                    await asyncio.wait_for(self.wake.wait(), keepalive_s)
                except TimeoutError:
                    yield None
                continue
            ev = self.buffer.popleft()
            if id_key(ev.entry_id) > id_key(self.cursor):
                self.cursor = ev.entry_id
                yield ev


class EventHub:
    def __init__(
        self,
        reader: Redis,
        redis: Redis,
        keys: Keys,
        *,
        wake_key: str,
        max_streams: int,
        block_ms: int = 5000,
        count: int = 200,
    ) -> None:
        self.reader = reader  # the one blocking connection
        self.redis = redis  # the shared pool: catch-up reads, wake-ups
        self.keys = keys
        self.wake_key = wake_key
        self.max_streams = max_streams
        self.block_ms = block_ms
        self.count = count
        self._streams: dict[str, tuple[str, set[Subscription]]] = {}
        self._changed = asyncio.Event()
        self._wake_cursor = "0-0"
        self._junk: dict[str, float] = {}  # key that is no stream -> retry after (loop time)
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self.reads = 0  # blocking reads issued (bench)

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    @property
    def subscribers(self) -> int:
        return sum(len(subs) for _c, subs in self._streams.values())

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="event-hub")

    async def stop(self) -> None:
        """Let the blocked read end by itself (within ``block_ms``), then cancel: a read
        cancelled mid-command costs its connection, and some clients hang on it."""
        if self._task is None:
            return
        self._stopping = True
        self._changed.set()
        await asyncio.wait({self._task}, timeout=self.block_ms / 1000 + 1)
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    def has_room(self, session_key: str) -> bool:
        """Whether following ``session_key`` stays within ``max_streams``."""
        stream = self.keys.out(session_key)
        return stream in self._streams or len(self._streams) < self.max_streams

    @contextlib.asynccontextmanager
    async def subscribe(self, session_key: str, after: str) -> AsyncIterator[Subscription]:
        """Follow ``session_key``'s events after ``after`` (an entry id, ``0`` for
        everything kept, ``$`` for new ones only)."""
        stream = self.keys.out(session_key)
        if not self.has_room(session_key):
            raise TooManyStreamsError(f"{self.max_streams} event streams open")
        last = await self.last_id(stream)
        cursor, gap = await self._start_point(stream, after, last)
        sub = Subscription(self, stream, cursor, gap)
        if not self.has_room(session_key):  # others took the room while we read Redis
            raise TooManyStreamsError(f"{self.max_streams} event streams open")
        if stream not in self._streams:
            self._streams[stream] = (last, set())
            await self._wake()
        self._streams[stream][1].add(sub)
        try:
            yield sub
        finally:
            entry = self._streams.get(stream)
            if entry is not None:
                entry[1].discard(sub)
                if not entry[1]:
                    del self._streams[stream]

    async def _start_point(self, stream: str, after: str, last: str) -> tuple[str, bool]:
        if after == "$":
            return last, False
        if after in ("0", "0-0", ""):
            return "0-0", False
        # is the cursor itself (or an older entry) still kept? If not, a gap.
        try:
            older = await self.redis.xrevrange(stream, after, "-", count=1)
        except ResponseError:
            older = []
        return after, not older

    async def last_id(self, stream: str) -> str:
        try:
            last = await self.redis.xrevrange(stream, "+", "-", count=1)
        except ResponseError:  # junk where the events belong: replaced by the next commit
            return "0-0"
        return text(last[0][0]) if last else "0-0"

    async def read_after(self, stream: str, cursor: str) -> list[HubEvent]:
        try:
            reply = await self.redis.xread({stream: cursor}, count=self.count)
        except ResponseError:
            return []
        return [ev for _s, batch in reply or [] for ev in _decode(batch)]

    async def _wake(self) -> None:
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.xadd(self.wake_key, {"w": "1"}, maxlen=1, approximate=False)
                pipe.pexpire(self.wake_key, 600_000)
                await pipe.execute()
        except RedisError:
            log.warning(
                "could not wake the event reader; new streams join within %d ms", self.block_ms
            )
        self._changed.set()

    async def _run(self) -> None:
        delay_s = 0.1
        while not self._stopping:
            if not self._streams:
                self._changed.clear()
                await self._changed.wait()
                continue
            try:
                await self._read_once()
                delay_s = 0.1
            except (RedisError, OSError) as exc:
                log.warning(
                    "event read failed (%s); retrying in %.1fs", type(exc).__name__, delay_s
                )
                await asyncio.sleep(delay_s)
                delay_s = min(delay_s * 2, 5.0)

    async def _read_once(self) -> None:
        now = asyncio.get_running_loop().time()
        position: dict[Any, Any] = {
            s: c for s, (c, _subs) in self._streams.items() if self._junk.get(s, 0.0) <= now
        }
        position[self.wake_key] = self._wake_cursor
        self.reads += 1
        try:
            reply = await self.reader.xread(position, count=self.count, block=self.block_ms)
        except ResponseError as exc:
            if "WRONGTYPE" not in str(exc):
                raise
            await self._drop_junk(position)
            return
        for raw_stream, batch in reply or []:
            stream = text(raw_stream)
            if stream == self.wake_key:
                self._wake_cursor = text(batch[-1][0])
                continue
            entry = self._streams.get(stream)
            if entry is None or not batch:
                continue
            events = _decode(batch)
            self._streams[stream] = (text(batch[-1][0]), entry[1])
            for sub in list(entry[1]):
                for ev in events:
                    sub.push(ev)

    async def _drop_junk(self, position: dict[Any, Any]) -> None:
        """A followed key that is no stream (junk a worker's next commit replaces): left
        out of the shared read for a second at a time."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for stream in position:
                pipe.type(stream)
            kinds = await pipe.execute()
        retry_at = asyncio.get_running_loop().time() + 1.0
        for stream, kind in zip(position, kinds, strict=True):
            if text(kind) not in ("stream", "none"):
                self._junk[stream] = retry_at
                if stream in self._streams:
                    self._streams[stream] = ("0-0", self._streams[stream][1])
        for stream in [s for s, t in self._junk.items() if t < retry_at - 1.0]:
            del self._junk[stream]


def _decode(batch: list[Any]) -> list[HubEvent]:
    out = []
    for eid, raw in batch:
        try:
            event = OutboundMessage.model_validate_json(fields(raw).get("payload", ""))
        except ValidationError:
            continue
        event.entry_id = text(eid)
        out.append(HubEvent("event", text(eid), event))
    return out
