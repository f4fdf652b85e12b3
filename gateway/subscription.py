"""A subscriber of one event stream in a gateway process (``EventHub``): the events handed
to it, buffered up to a bound, and the catch-up from Redis when it starts, when it fell
behind, or when Redis may have trimmed what it missed (a ``gap``)."""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from bus_redis import OutboundMessage
from bus_redis.aio import still_wanted

BUFFER_MAX = 256  # entries buffered per subscriber before it re-reads from Redis instead
BUFFER_BYTES = 1 << 20  # ... or bytes of their text (long answers, a reader that stalls)
# a catch-up read takes this many bytes of events (by the largest one seen on the stream,
# 16 at most) and holds no more than that beyond the first: answers that copy a message's
# metadata are up to a payload each, and 16 of them read and held by each of a user's 64
# stalled streams were 250 MiB (a helper's attack, stop 52); its first read takes one
CATCH_UP_BYTES = 256 << 10
CATCH_UP_MAX = 16


class Source(Protocol):
    """Where a subscriber catches up from (``EventHub``)."""

    async def first_id(self, stream: str) -> str | None: ...

    async def read_after(
        self, stream: str, cursor: str, count: int = ..., budget: int = ..., owner: str = ...
    ) -> tuple[list[HubEvent], str]: ...


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
    hub: Source
    stream: str
    cursor: str
    gap: bool = False
    buffer: deque[HubEvent] = field(default_factory=deque)
    catch_up: bool = True
    missed_from: str = ""  # set when the buffer overflowed
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    buffered_bytes: int = 0  # of the buffered events' text
    largest: int = 0  # bytes of the largest event a catch-up read here (0: none yet)
    owner: str = ""  # the user following (a share of catch-up reads each)

    def push(self, ev: HubEvent) -> None:
        size = event_size(ev)
        if len(self.buffer) >= BUFFER_MAX or self.buffered_bytes + size > BUFFER_BYTES:
            # a slow reader: read again from Redis instead
            if not self.missed_from:  # the oldest event it has not been given
                self.missed_from = self.buffer[0].entry_id if self.buffer else ev.entry_id
            self._drop()
            self.catch_up = True
        else:
            self.buffer.append(ev)
            self.buffered_bytes += size
        self.wake.set()

    def _count(self) -> int:
        """Events the next catch-up read takes: about ``CATCH_UP_BYTES`` of them."""
        if not self.largest:
            return 1
        return max(1, min(CATCH_UP_MAX, CATCH_UP_BYTES // self.largest))

    def _drop(self) -> None:
        self.buffer.clear()
        self.buffered_bytes = 0

    async def events(self, keepalive_s: float) -> AsyncIterator[HubEvent | None]:
        """Events after the cursor, in order, forever; ``None`` every ``keepalive_s``
        without one (for keep-alive comments)."""
        if self.gap:
            yield HubEvent("gap", self.cursor)
        while True:
            still_wanted()
            if self.catch_up:
                self.catch_up = False
                self._drop()
                if self.missed_from:  # so far behind that Redis may have trimmed what it missed
                    missed, self.missed_from = self.missed_from, ""
                    first = await self.hub.first_id(self.stream)
                    still_wanted()
                    if first is None or id_key(first) > id_key(missed):
                        yield HubEvent("gap", self.cursor)
                events, last = await self.hub.read_after(
                    self.stream, self.cursor, self._count(), CATCH_UP_BYTES, self.owner
                )
                still_wanted()
                self.largest = max([self.largest, *(event_size(ev) for ev in events)])
                for ev in events:
                    self.cursor = ev.entry_id
                    yield ev
                    self.catch_up = True  # read on until nothing is left
                if last and id_key(last) > id_key(self.cursor):  # entries that are no event
                    self.cursor, self.catch_up = last, True
                continue
            if not self.buffer:
                self.wake.clear()
                try:
                    await asyncio.wait_for(self.wake.wait(), keepalive_s)
                except TimeoutError:
                    yield None
                continue
            ev = self.buffer.popleft()
            self.buffered_bytes -= event_size(ev)
            if id_key(ev.entry_id) > id_key(self.cursor):
                self.cursor = ev.entry_id
                yield ev


def event_size(ev: HubEvent) -> int:
    """What an event holds, near enough: its text (an answer, a delta, an error) and its
    metadata (a user's message metadata is copied into its answer)."""
    if ev.event is None:
        return 0
    meta = ev.event.metadata
    return len(ev.event.content) + (len(json.dumps(meta, default=str)) if meta else 0)
