"""EventHub: every open event stream of a gateway process over one blocking Redis read.

A few tasks (``AGENT_GATEWAY_READERS``, one blocking connection each) each follow a share
of the event streams (``P:{C}:out:S``) that any client of this process follows: each
blocks on the channel's pulse (``bus_redis.pulse``: workers name a stream there whenever
they add an event to it) and its own wake stream, then reads, without blocking, only the
streams of its share the pulses named, and hands each entry to the subscribers of its
session. So Redis connections stay bounded (the readers plus the shared pool) however
many SSE or WebSocket clients are open, and a wake-up costs the events that happened, not
the number of streams followed. A stream newly followed is read once from its cursor
before the next blocking read; a reader whose pulses were trimmed reads its whole share.

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
import zlib
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError
from redis.asyncio import Redis
from redis.exceptions import NoPermissionError, RedisError, ResponseError

from bus_redis import OutboundMessage
from bus_redis.aio import still_wanted
from bus_redis.codec import fields, parse_stream_id, text
from bus_redis.keys import Keys
from bus_redis.pulse import PulseWatch
from gateway.subscription import HubEvent, Subscription, event_size

log = logging.getLogger(__name__)

# events one subscriber's catch-up reads at a time: it holds them while its client takes
# the first, so a slow client behind long answers holds a few, never hundreds
CATCH_UP_COUNT = 16
# catch-up reads in flight at once per process: what they read is in memory until it is
# cut to the subscriber's budget (64 streams of one user catching up at once read 64 x 16
# long answers together); and per user, so that one user's many resumes leave the others
# theirs (60 of one user's made another's resume of 300 short events take 5-7 s)
CATCH_UP_READS = 4
CATCH_UP_READS_PER_USER = 1


class TooManyStreamsError(Exception):
    """The process follows ``max_streams`` event streams already."""


class _Reader:
    """One blocking connection: the channel's pulse and its own wake stream; then its share
    of the followed streams (a stream always goes to the same reader) that were named."""

    def __init__(self, hub: EventHub, redis: Redis, wake_key: str) -> None:
        self.hub = hub
        self.redis = redis
        self.wake_key = wake_key
        self.streams: dict[str, tuple[str, set[Subscription]]] = {}  # stream -> (cursor, subs)
        self.fresh: set[str] = set()  # streams followed since the last read: read them once
        self.changed = asyncio.Event()
        self.wake_cursor = "0-0"
        self.junk: dict[str, float] = {}  # key that is no stream -> retry after (loop time)
        self.deferred: set[str] = set()  # named while junk: read again when their time is up
        self.pulses = PulseWatch(redis, hub.keys)
        self.task: asyncio.Task[None] | None = None

    async def wake(self) -> None:
        """End this reader's blocked read, so it reads a stream just added."""
        try:
            async with self.hub.redis.pipeline(transaction=False) as pipe:
                pipe.xadd(self.wake_key, {"w": "1"}, maxlen=1, approximate=False)
                pipe.pexpire(self.wake_key, 600_000)
                await pipe.execute()
        except RedisError:
            log.warning(
                "could not wake an event reader; new streams join within %d ms", self.hub.block_ms
            )
        self.changed.set()

    async def run(self) -> None:
        delay_s = 0.1
        while not self.hub.stopping:
            if not self.streams:
                self.changed.clear()
                await self.changed.wait()
                continue
            try:
                await self.read_once()
                delay_s = 0.1
            except NoPermissionError:
                log.error(
                    "the gateway's Redis user may not read the channel's pulse: re-apply "
                    "`agent-worker acl gateway --apply` (its lines changed); retrying"
                )
                await asyncio.sleep(5.0)
            except (RedisError, OSError) as exc:
                log.warning(
                    "event read failed (%s); retrying in %.1fs", type(exc).__name__, delay_s
                )
                await asyncio.sleep(delay_s)
                delay_s = min(delay_s * 2, 5.0)

    async def read_once(self) -> None:
        if not self.pulses.cursors:  # before any stream is read (see bus_redis.pulse)
            await self.pulses.add_channels([self.hub.channel])
        if self.fresh:  # followed since the last read: from their cursors, once
            fresh, self.fresh = self.fresh, set()
            await self.read_streams(fresh)
            return
        loop_now = asyncio.get_running_loop().time()
        due = {s for s in self.deferred if self.junk.get(s, 0.0) <= loop_now}
        if due:  # named while they were junk: read them again now
            self.deferred -= due
            await self.read_streams(due)
            return
        hub = self.hub
        hub.reads += 1
        block_ms = hub.block_ms
        if self.deferred:  # wake up in time for the first of them
            first = min(self.junk.get(s, loop_now) for s in self.deferred)
            block_ms = max(1, min(block_ms, int((first - loop_now) * 1000) + 1))
        named, others = await self.pulses.wait(block_ms, {self.wake_key: self.wake_cursor})
        if others.get(self.wake_key):
            self.wake_cursor = text(others[self.wake_key][-1][0])
        await self.read_streams(set(self.streams) if named is None else named)

    async def read_streams(self, names: set[str]) -> None:
        """Read (without blocking) the followed streams among ``names`` until they have
        nothing more, and hand their entries to their subscribers. A stream that is junk
        for now (a key of another type, which its session's next commit replaces) is
        read again once its second is up, so an event named meanwhile is not lost."""
        hub = self.hub
        now = asyncio.get_running_loop().time()
        wanted = set()
        for stream in names & self.streams.keys():
            if self.junk.get(stream, 0.0) > now:
                self.deferred.add(stream)
            else:
                wanted.add(stream)
        while wanted:
            position: dict[Any, Any] = {s: self.streams[s][0] for s in wanted if s in self.streams}
            if not position:
                return
            try:
                reply = await self.redis.xread(position, count=hub.count)
            except ResponseError as exc:
                if "WRONGTYPE" not in str(exc):
                    raise
                wanted = await self.drop_junk(position)  # the others, read again now
                continue
            wanted = set()
            for raw_stream, batch in reply or []:
                stream = text(raw_stream)
                entry = self.streams.get(stream)
                if entry is None or not batch:
                    continue
                events = _decode(batch)
                self.streams[stream] = (text(batch[-1][0]), entry[1])
                for sub in list(entry[1]):
                    for ev in events:
                        sub.push(ev)
                if len(batch) >= hub.count:
                    wanted.add(stream)

    async def drop_junk(self, position: dict[Any, Any]) -> set[str]:
        """Keys of ``position`` that are no stream (junk a worker's next commit replaces)
        are left out for a second (and read again then); returns the others."""
        async with self.hub.redis.pipeline(transaction=False) as pipe:
            for stream in position:
                pipe.type(stream)
            kinds = await pipe.execute()
        retry_at = asyncio.get_running_loop().time() + 1.0
        fine = set()
        for stream, kind in zip(position, kinds, strict=True):
            if text(kind) in ("stream", "none"):
                fine.add(stream)
                continue
            self.junk[stream] = retry_at
            self.deferred.add(stream)
            if stream in self.streams:
                self.streams[stream] = ("0-0", self.streams[stream][1])
        for stream in [s for s, t in self.junk.items() if t < retry_at - 1.0]:
            del self.junk[stream]
        return fine


class EventHub:
    """Followed streams are spread over ``len(readers)`` blocking connections (by a hash
    of the stream name), so each wake-up re-sends only its reader's share of the streams."""

    def __init__(
        self,
        readers: list[Redis],
        redis: Redis,
        keys: Keys,
        *,
        channel: str,
        wake_key: str,
        max_streams: int,
        block_ms: int = 5000,
        count: int = 200,
    ) -> None:
        self.redis = redis  # the shared pool: catch-up reads, wake-ups
        self.keys = keys
        self.channel = channel  # whose pulse the readers block on
        self.max_streams = max_streams
        self.block_ms = block_ms
        self.count = count
        self._readers = [_Reader(self, r, f"{wake_key}:{i}") for i, r in enumerate(readers)]
        self.stopping = False
        self.reads = 0  # blocking reads issued (bench)
        self._catching_up = asyncio.Semaphore(CATCH_UP_READS)
        # user -> (their catch-up reads' semaphore, reads holding or waiting for it): an
        # entry only while in use
        self._users_catching_up: dict[str, tuple[asyncio.Semaphore, list[int]]] = {}

    @property
    def open_streams(self) -> int:
        return sum(len(r.streams) for r in self._readers)

    @property
    def subscribers(self) -> int:
        return sum(len(subs) for r in self._readers for _c, subs in r.streams.values())

    def _reader(self, stream: str) -> _Reader:
        return self._readers[zlib.crc32(stream.encode()) % len(self._readers)]

    def start(self) -> None:
        for i, reader in enumerate(self._readers):
            reader.task = asyncio.create_task(reader.run(), name=f"event-reader-{i}")

    async def stop(self) -> None:
        """Let the blocked reads end by themselves (within ``block_ms``), then cancel: a
        read cancelled mid-command costs its connection, and some clients hang on it."""
        tasks = {r.task for r in self._readers if r.task is not None}
        if not tasks:
            return
        self.stopping = True
        for reader in self._readers:
            reader.changed.set()
        await asyncio.wait(tasks, timeout=self.block_ms / 1000 + 1)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def has_room(self, session_key: str) -> bool:
        """Whether following ``session_key`` stays within ``max_streams``."""
        stream = self.keys.out(session_key)
        return stream in self._reader(stream).streams or self.open_streams < self.max_streams

    @contextlib.asynccontextmanager
    async def subscribe(
        self, session_key: str, after: str, owner: str = ""
    ) -> AsyncIterator[Subscription]:
        """Follow ``session_key``'s events after ``after`` (an entry id, ``0`` for
        everything kept, ``$`` for new ones only), for ``owner`` (a user: whose share of
        catch-up reads it takes)."""
        stream = self.keys.out(session_key)
        if not self.has_room(session_key):
            raise TooManyStreamsError(f"{self.max_streams} event streams open")
        last = await self.last_id(stream)
        cursor, gap = await self._start_point(stream, after, last)
        still_wanted()
        sub = Subscription(self, stream, cursor, gap, owner=owner)
        if not self.has_room(session_key):  # others took the room while we read Redis
            raise TooManyStreamsError(f"{self.max_streams} event streams open")
        reader = self._reader(stream)
        new = stream not in reader.streams
        if new:
            reader.streams[stream] = (last, set())
            reader.fresh.add(stream)
        reader.streams[stream][1].add(sub)  # registered before any await: always undone
        try:
            if new:
                await reader.wake()
                still_wanted()
            yield sub
        finally:
            entry = reader.streams.get(stream)
            if entry is not None:
                entry[1].discard(sub)
                if not entry[1]:
                    del reader.streams[stream]

    async def _start_point(self, stream: str, after: str, last: str) -> tuple[str, bool]:
        if after == "$":
            return last, False
        if after in ("0", "0-0", ""):
            return "0-0", False
        if parse_stream_id(after) > parse_stream_id(last):
            return last, True  # past every event the chat has (maybe none): not its cursor
        return after, not await self.cursor_kept(stream, after)

    async def first_id(self, stream: str) -> str | None:
        try:
            reply = await self.redis.xread({stream: "0-0"}, count=1)
        except ResponseError:
            return None
        return text(reply[0][1][0][0]) if reply and reply[0][1] else None

    async def cursor_kept(self, stream: str, cursor: str) -> bool:
        """Whether the cursor itself, or an older entry, is still kept (else events after
        it may have been trimmed: a gap)."""
        if cursor == "0-0":
            return True
        try:
            return bool(await self.redis.xrevrange(stream, cursor, "-", count=1))
        except ResponseError:
            return False

    async def last_id(self, stream: str) -> str:
        try:
            last = await self.redis.xrevrange(stream, "+", "-", count=1)
        except ResponseError:  # junk where the events belong: replaced by the next commit
            return "0-0"
        return text(last[0][0]) if last else "0-0"

    @contextlib.asynccontextmanager
    async def _turn(self, owner: str) -> AsyncIterator[None]:
        """A catch-up read's turn: ``CATCH_UP_READS_PER_USER`` of ``owner``'s at once (its
        semaphore kept while anyone holds or waits for it), ``CATCH_UP_READS`` in all."""
        share = self._users_catching_up.get(owner)
        if share is None:
            share = (asyncio.Semaphore(CATCH_UP_READS_PER_USER), [0])
            self._users_catching_up[owner] = share
        semaphore, users = share
        users[0] += 1
        try:
            async with semaphore, self._catching_up:
                yield
        finally:
            users[0] -= 1
            if not users[0]:
                del self._users_catching_up[owner]

    async def read_after(
        self,
        stream: str,
        cursor: str,
        count: int = CATCH_UP_COUNT,
        budget: int = 0,
        owner: str = "",
    ) -> tuple[list[HubEvent], str]:
        """The next ``count`` events after ``cursor`` at most, and the id of the last
        entry taken ('' none): entries that are no event are passed over, so a catch-up
        reads on past them (it stopped there, as if caught up). With ``budget``, the events
        past that many bytes (the first one is always taken) are left for the next read,
        not held. ``CATCH_UP_READS`` run at once, ``CATCH_UP_READS_PER_USER`` of a user's
        (``owner``)."""
        async with self._turn(owner):
            try:
                reply = await self.redis.xread({stream: cursor}, count=count)
            except ResponseError:
                return [], ""
            entries = [entry for _s, batch in reply or [] for entry in batch]
            del reply
            taken: list[HubEvent] = []
            last, held = "", 0
            for entry in entries:
                decoded = _decode([entry])
                size = sum(event_size(ev) for ev in decoded)
                if budget and taken and held + size > budget:
                    break
                taken += decoded
                held += size
                last = text(entry[0])
            return taken, last


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
