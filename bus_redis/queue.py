"""The worker's side of the ready queues: a channel's ``P:{C}:ready`` stream (consumer
group ``workers``) and a worker's inbox name sessions that have work. Read, sorted (a
ready queue only ever names sessions of its own channel), acknowledged, claimed from
dead or stuck consumers, handed back at shutdown, forwarded to a private session's owner.
``RedisBus`` is one; the blocking read goes over a multiplexed connection of its own
(``reader``) when the client allows one.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Iterable, Sequence
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from bus_redis.codec import binary_twin, safe, strict_text, text
from bus_redis.keys import UNIFIED_CHANNEL, Keys, channel_of, in_channel
from bus_redis.mux import Multiplexed
from bus_redis.results import Notification

WORKER_GROUP = "workers"
READY_MAXLEN = 1_000_000
# a worker's inbox (forwards to the owner of a private session): a frontend that floods
# its ready queue with one private session's key makes every other worker forward each
# note; past this many the oldest go (the owner's check of its sessions, every
# maintenance tick, serves one whose forward went)
INBOX_MAXLEN = 10_000
# what Redis answers about a ready queue that can never serve again (as Redis and redis-py
# word it): another type at its name, or a stream at the maximal id (no XADD * succeeds)
UNUSABLE_QUEUE = ("WRONGTYPE", "exhausted the last possible ID", "equal or smaller than the target")
log = logging.getLogger(__name__)


def unusable_queue(why: str) -> bool:
    """Whether a refusal means the queue itself is unusable (see UNUSABLE_QUEUE), not that
    Redis is in a state (out of memory, read-only, loading) that passes."""
    return any(phrase in why for phrase in UNUSABLE_QUEUE)


class ReadyQueues:
    """The ready-queue half of ``RedisBus`` (which sets the attributes below)."""

    redis: Redis
    keys: Keys
    reader: Multiplexed | None  # the blocking read's own connection (None: redis-py's)
    _raw: Redis | None

    @property
    def raw(self) -> Redis:
        """A twin client that returns bytes, made on first use: queues, SCAN and pub/sub
        carry bytes from the wire that may not be UTF-8. Closed by :meth:`aclose`."""
        if self._raw is None:
            self._raw = binary_twin(self.redis)
        return self._raw

    def note_streams(self, worker_id: str, channels: Iterable[str]) -> list[str]:
        """The streams this worker reads: its inbox and every channel's ready queue."""
        return [self.keys.inbox(worker_id), *(self.keys.ready(c) for c in sorted(channels))]

    async def ensure_groups(self, streams: Iterable[str]) -> None:
        """The consumer group of each stream, made where missing. A key of another type at
        a queue's name (an operator's mistake) would fail every read of every channel: it
        is replaced by the queue (its sessions are found again by the sweeps)."""
        for stream in streams:
            try:
                await self.redis.xgroup_create(stream, WORKER_GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" in str(exc):
                    continue
                if not unusable_queue(str(exc)):
                    raise
                log.warning("%s is no stream (%s); re-created", safe(stream), safe(str(exc)))
                await self.redis.delete(stream)
                await self.redis.xgroup_create(stream, WORKER_GROUP, id="0", mkstream=True)

    async def repair_ready(self, channel: str, why: str) -> None:
        """A ready queue that takes no entry because of what is in it (a frontend gave it
        the maximal id, or made it another type): it is re-created empty with its group.
        Notifications still in it are found again by ``Sweeps.queued``; no other channel is
        touched. Any other refusal (Redis out of memory, read-only, loading) is Redis'
        state, not the queue's: the queue is left as it is and the sweep tried again."""
        if not unusable_queue(why):
            log.warning("ready queue of %s takes no entry for now (%s)", safe(channel), safe(why))
            return
        log.warning("ready queue of %s takes no entry (%s); re-created", safe(channel), safe(why))
        ready = self.keys.ready(channel)
        await self.redis.delete(ready)
        await self.ensure_groups([ready])

    async def read_notifications(
        self, worker_id: str, streams: Sequence[str], *, count: int, block_ms: int
    ) -> list[Notification]:
        if self.reader is not None:  # not the pool: a read per notification or two (many workers)
            command = ["XREADGROUP", "GROUP", WORKER_GROUP, worker_id, "COUNT", count]
            command += ["BLOCK", block_ms, "STREAMS", *streams, *(">" for _ in streams)]
            try:
                reply = await self.reader.execute(*command)
            except asyncio.CancelledError:  # (a stop): the server must not hand this
                await self.reader.aclose()  # consumer entries after it has left
                raise
        else:
            reply = await self.raw.xreadgroup(
                WORKER_GROUP,
                worker_id,
                dict.fromkeys(streams, ">"),
                count=count,
                block=block_ms,
            )
        per_stream: list[list[Notification]] = []
        junk: list[Notification] = []
        for stream, entries in reply or []:  # COUNT is per stream: at most n per channel
            per_stream.append([])
            self._sort(text(stream), entries, per_stream[-1], junk)
        if junk:
            await self.ack(junk)
        # channels take turns, so none is served only after another's whole batch
        return [n for row in itertools.zip_longest(*per_stream) for n in row if n is not None]

    def _sort(
        self, stream: str, entries: Iterable[Any], notes: list[Notification], junk: list[Any]
    ) -> None:
        """Split entries into notifications and junk. A ready queue of channel C only ever
        names sessions of C (a frontend cannot make workers serve another channel)."""
        channel = self.keys.channel_of_ready(stream)
        for entry_id, raw in entries:
            f = raw if isinstance(raw, dict) else dict(zip(raw[::2], raw[1::2], strict=True))
            session = strict_text(f.get(b"session", f.get("session"))) or ""  # not UTF-8: junk
            effective = strict_text(f.get(b"effective", f.get("effective"))) == "1"
            note = Notification(stream, text(entry_id), session, effective=effective)
            if channel is None and stream.endswith(f"{{{UNIFIED_CHANNEL}}}:ready"):
                channel = UNIFIED_CHANNEL
            if channel is not None and not in_channel(session, channel):
                log.warning("dropped a notification for %s on %s", safe(session), stream)
                junk.append(note)
            elif not session:
                junk.append(note)
            else:
                notes.append(note)

    async def claim_stale(
        self, worker_id: str, streams: Sequence[str], *, min_idle_ms: int, count: int = 100
    ) -> list[Notification]:
        """Take over ready entries another consumer read but did not acknowledge for
        ``min_idle_ms`` (it died, or it is stuck)."""
        notes: list[Notification] = []
        junk: list[Notification] = []
        for stream in streams:
            reply = await self.raw.xautoclaim(
                stream, WORKER_GROUP, worker_id, min_idle_ms, "0-0", count=count
            )
            self._sort(stream, reply[1] if reply else [], notes, junk)
        if junk:
            await self.ack(junk)
        return notes

    async def claim_from(
        self, worker_id: str, dead: str, streams: Sequence[str], *, count: int = 100
    ) -> list[Notification]:
        """Take over the ready entries a dead worker read but did not acknowledge, at once
        (instead of after ``claim_stale``'s idle time)."""
        notes: list[Notification] = []
        junk: list[Notification] = []
        for stream in streams:
            pending = await self.raw.xpending_range(
                stream, WORKER_GROUP, min="-", max="+", count=count, consumername=dead
            )
            ids = [p["message_id"] for p in pending]
            if ids:
                claimed = await self.raw.xclaim(stream, WORKER_GROUP, worker_id, 0, ids)
                self._sort(stream, [c for c in claimed if c[1] is not None], notes, junk)
        if junk:
            await self.ack(junk)
        return notes

    async def ack(self, notes: Sequence[Notification]) -> None:
        if not any(n.entry_id for n in notes):
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for n in notes:
                if n.entry_id:  # synthetic notifications (owner self-check) have none
                    pipe.xack(n.stream, WORKER_GROUP, n.entry_id)
                    pipe.xdel(n.stream, n.entry_id)
            await pipe.execute()

    async def hand_back(self, worker_id: str, streams: Sequence[str], *, count: int = 1000) -> int:
        """Re-queue the entries delivered to us but not acknowledged (a blocking read
        cancelled at shutdown leaves them in our pending list) so others take them now."""
        handed = 0
        for stream in streams:
            if stream == self.keys.inbox(worker_id):
                continue
            pending = await self.redis.xpending_range(
                stream, WORKER_GROUP, min="-", max="+", count=count, consumername=worker_id
            )
            ids = [p["message_id"] for p in pending]
            if not ids:
                continue
            entries = await self.raw.xclaim(stream, WORKER_GROUP, worker_id, 0, ids)
            async with self.raw.pipeline(transaction=True) as pipe:
                for entry_id, raw in entries:
                    note: dict[Any, Any] = dict(raw) if isinstance(raw, dict) else {}
                    pipe.xadd(stream, note, maxlen=READY_MAXLEN, approximate=True)
                    pipe.xack(stream, WORKER_GROUP, entry_id)
                    pipe.xdel(stream, entry_id)
                await pipe.execute()
            handed += len(entries)
        return handed

    async def forward(self, owner: str, note: Notification) -> None:
        """Hand a notification to the worker that owns the (transient) session."""
        await self.redis.xadd(
            self.keys.inbox(owner), {"session": note.session_key}, maxlen=INBOX_MAXLEN,
            approximate=False,
        )  # fmt: skip

    async def notify(self, session_key: str) -> None:
        """A worker-side notification for stream ``session_key`` (sweeps, recovery)."""
        stream = self.keys.ready(channel_of(session_key))
        await self.redis.xadd(
            stream, {"session": session_key}, maxlen=READY_MAXLEN, approximate=True
        )
