"""PulseWatch: which followed event streams got events, from one blocking read of the
channels' pulse streams (``P:{C}:pulse``) instead of one over every followed stream.

Workers add the name of an event stream to its channel's pulse in the same script that
adds the event (``commit``, ``emit``, ``owner_lost``). A reader following many sessions
blocks on the pulses alone, then reads (without blocking) only the followed streams that
were named. Its cost per wake-up is the pulses since the last one and the streams they
name, not the number of sessions it follows. The pulse keeps ``PULSE_MAXLEN`` entries: a
reader that fell further behind finds the pulse trimmed past its position and is told to
read every followed stream once (``wait`` returns None).

Order: a reader takes its pulse positions *before* its first read of the followed
streams, so an event added after that read has a pulse after those positions.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from bus_redis.codec import fields, parse_stream_id, text
from bus_redis.keys import Keys

PULSE_BATCH = 1000  # pulses read at a time


class PulseWatch:
    def __init__(self, redis: Redis, keys: Keys, *, batch: int = PULSE_BATCH) -> None:
        self.redis = redis
        self.keys = keys
        self.batch = batch
        self.cursors: dict[str, str] = {}  # pulse key -> the last pulse seen

    async def add_channels(self, channels: Iterable[str]) -> None:
        """Watch these channels' pulses from now on (call before reading their streams)."""
        for channel in channels:
            key = self.keys.pulse(channel)
            if key not in self.cursors:
                self.cursors[key] = await self._last_id(key)

    async def wait(
        self, block_ms: int, extra: dict[str, str] | None = None
    ) -> tuple[set[str] | None, dict[str, list[Any]]]:
        """Block until pulses come (or ``block_ms``); returns the names of the event
        streams they named (None: the pulse was trimmed past a position, read every
        followed stream) and the entries of the ``extra`` streams read in the same call
        (e.g. a reader's own wake stream)."""
        position: dict[Any, Any] = {**self.cursors, **(extra or {})}
        try:
            reply = await self.redis.xread(position, count=self.batch, block=block_ms)
        except ResponseError as exc:  # a pulse that is no stream (the next event's script
            if "WRONGTYPE" not in str(exc):  # replaces it): read everything, at this pace
                raise
            await asyncio.sleep(block_ms / 1000)
            return None, {}
        named: set[str] | None = set()
        others: dict[str, list[Any]] = {}
        for raw_stream, batch in reply or []:
            stream = text(raw_stream)
            if stream not in self.cursors:
                others[stream] = batch
                continue
            before = self.cursors[stream]
            self.cursors[stream] = text(batch[-1][0])
            if named is not None:
                named |= {text(fields(raw).get("o", "")) for _eid, raw in batch}
            if len(batch) >= self.batch and await self._trimmed(stream, before):
                named = None
        return named, others

    async def _trimmed(self, stream: str, before: str) -> bool:
        """Whether pulses after ``before`` may have been trimmed (the first kept is later)."""
        first = await self.redis.xrange(stream, "-", "+", count=1)
        return bool(first) and parse_stream_id(text(first[0][0])) > parse_stream_id(before)

    async def _last_id(self, key: str) -> str:
        try:
            last = await self.redis.xrevrange(key, "+", "-", count=1)
        except ResponseError as exc:  # junk where the pulse belongs (NOPERM is raised)
            if "WRONGTYPE" not in str(exc):
                raise
            return "0-0"
        return text(last[0][0]) if last else "0-0"
