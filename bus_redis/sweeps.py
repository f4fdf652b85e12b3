"""Sweeps: recovery of sessions nobody serves, and clean-up of what frontends left.

Every step is bounded per call and per channel, so what one channel wrote (hundreds of
thousands of keys, junk types, a ready queue at the maximal id) neither stops nor slows
recovery in another channel:

- dead holders (:class:`bus_redis.takeovers.Takeovers`, a part of ``Sweeps``): liveness
  beats, and the leases of a worker found silent taken over at once;
- :meth:`Sweeps.leases` re-notifies keys whose holder died (each channel's lease registry,
  at most ``limit`` keys per channel and call);
- :meth:`Sweeps.queued` walks each channel's own index ``P:{C}:queued`` (written by the
  frontend at publish), at most ``QUEUED_SWEEP`` due members per channel and call:
  stranded sessions are re-notified, empty ones forgotten, the rest looked at again later;
- :meth:`Sweeps.keyspace` and :meth:`Sweeps.hints` are the janitor, one SCAN step per
  call: streams no index names, empty streams, malformed names, orphan hints. A full pass
  takes keyspace / ``SCAN_COUNT`` calls, so recovery never depends on it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from redis.exceptions import NoScriptError, ResponseError

from bus_redis.codec import safe, stream_id_ms, strict_text, text, texts
from bus_redis.keys import UNIFIED_CHANNEL, channel_of, in_channel
from bus_redis.scripts import script_sha
from bus_redis.streams import READY_MAXLEN, WORKER_GROUP, RedisBus
from bus_redis.takeovers import Takeovers, unified_flag

SCAN_COUNT = 1000  # keys visited per janitor step
QUEUED_SWEEP = 500  # members of one channel's queued index looked at per call
IN_FLIGHT_MS = 1000  # a younger queued entry is assumed to have its notification on the way
RECHECK_MS = 5000  # a served (or just re-notified) session is looked at again after this
BACKLOG_MS = 60_000  # a notification unread in its ready queue is believed on its way this long
log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Look:
    """What one look at a session stream found."""

    empty: list[str]
    stranded: list[str]
    later: dict[str, int]  # session -> when to look again (ms)


def _delivered_ms(groups: Any, length: Any) -> int | None:
    """When the newest notification the workers' group of a ready queue has read was
    published (ms; ``XINFO GROUPS``); None when unknown (no such group, an error) or when
    nothing in the queue waits unread: its length less the group's read but unacknowledged
    entries (a notification is deleted once acknowledged; ``lag`` is unknown after a
    deletion)."""
    if isinstance(groups, Exception) or not isinstance(length, int):
        return None
    for g in groups or []:
        if text(g.get("name", g.get(b"name"))) == WORKER_GROUP:
            pending = g.get("pending", g.get(b"pending"))
            if not isinstance(pending, int) or length - pending <= 0:
                return None
            last = text(g.get("last-delivered-id", g.get(b"last-delivered-id")))
            return stream_id_ms(last) if last else None
    return None


def _waiting(delivered_ms: int | None, first_ms: int, now: int) -> bool:
    """Whether a session's oldest entry (published at ``first_ms``) still has its
    notification in the ready queue, unread: the workers' group has read nothing published
    since (a backlog: the queue is longer than ``IN_FLIGHT_MS`` of turns). Re-notifying it
    would only queue a second notification behind the first, and every such duplicate costs
    a worker an acquire that finds nothing: the sweep would add load where load is already
    too high. Believed for ``BACKLOG_MS`` at most (a ready queue re-created meanwhile reads
    from its start, and a notification trimmed from it is never read)."""
    return delivered_ms is not None and delivered_ms < first_ms and now - first_ms < BACKLOG_MS


class Sweeps(Takeovers):
    def __init__(self, bus: RedisBus) -> None:
        self.bus = bus
        self.redis = bus.redis
        self.keys = bus.keys
        self._cursor = 0  # of the keyspace janitor, kept across calls
        self._hint_cursor = 0

    async def leases(self, channels: Iterable[str], *, limit: int = 100) -> list[str]:
        """Re-notify keys whose lease expired without a release (their holder died): a
        session continues one lease TTL (plus a tick) after its holder's death."""
        done: list[str] = []
        for channel in channels:
            keys = [self.keys.leases(channel), self.keys.ready(channel)]
            try:
                args = [limit, READY_MAXLEN, unified_flag(channel)]
                reply = texts(await self.bus.scripts.call("sweep", keys, args))
            except ResponseError as exc:
                log.warning("lease sweep of channel %s failed: %s", safe(channel), safe(str(exc)))
                continue
            if reply[:1] == ["!unusable"]:
                await self.repair_ready(channel, reply[1])
                continue
            done += reply
        return done

    async def repair_ready(self, channel: str, why: str) -> None:
        """See :meth:`bus_redis.queue.ReadyQueues.repair_ready`."""
        await self.bus.repair_ready(channel, why)

    # --- the per-channel index ----------------------------------------------------------
    async def queued(
        self,
        channel: str,
        *,
        unified: bool,
        count: int = QUEUED_SWEEP,
        in_flight_ms: int = IN_FLIGHT_MS,
        recheck_ms: int = RECHECK_MS,
    ) -> list[str]:
        """Re-notify the channel's stranded sessions (queued entries, nobody serving them)
        among at most ``count`` due members of ``P:{C}:queued``; returns them."""
        index = self.keys.queued(channel)
        now = await self._now_ms()
        due = await self.bus.raw.zrangebyscore(index, "-inf", now, start=0, num=count)
        sessions = [n for n in (strict_text(r) for r in due) if n and in_channel(n, channel)]
        if len(sessions) < len(due):  # not a session of this channel: never acted upon
            await self.bus.raw.zrem(index, *(r for r in due if strict_text(r) not in sessions))
        if not sessions:
            return []
        look = await self._look(
            sessions, unified=unified, now=now, in_flight_ms=in_flight_ms, recheck_ms=recheck_ms
        )
        async with self.redis.pipeline(transaction=False) as pipe:
            for s in look.empty:
                pipe.evalsha(script_sha("tidy"), 6, *self._tidy_keys(s), s)
            if look.later:
                pipe.zadd(index, look.later, xx=True)
            for s in look.stranded:
                ready = self.keys.ready(channel)
                pipe.xadd(ready, {"session": s}, maxlen=READY_MAXLEN, approximate=True)
            replies = await pipe.execute(raise_on_error=False)
        if any(isinstance(r, NoScriptError) for r in replies):
            await self.bus.scripts.load_all()  # the next call tidies
        notified = replies[len(replies) - len(look.stranded) :]
        failed = [r for r in notified if isinstance(r, Exception)]
        if failed:
            await self.repair_ready(channel, str(failed[0]))
            return []
        return look.stranded

    async def _look(
        self,
        sessions: list[str],
        *,
        unified: bool,
        now: int,
        in_flight_ms: int = IN_FLIGHT_MS,
        recheck_ms: int = RECHECK_MS,
    ) -> _Look:
        """Classify sessions: empty (forget), stranded (re-notify), and when to look at
        each of the others again (a young entry's notification is on its way; a held or
        private one is served)."""
        k = self.keys
        channels = list(dict.fromkeys(channel_of(s) for s in sessions))
        u = f"{UNIFIED_CHANNEL}:default"
        async with self.bus.raw.pipeline(transaction=False) as pipe:
            for s in sessions:
                pipe.xrange(k.inbound(s), "-", "+", count=1)
                pipe.exists(k.lease(s))
                pipe.exists(k.owner(s))
                pipe.sismember(k.pending(u), s)
            for c in channels:
                pipe.xinfo_groups(k.ready(c))
                pipe.xlen(k.ready(c))
            pipe.exists(k.lease(u))
            res: list[Any] = await pipe.execute(raise_on_error=False)
        unified_held = res[-1] == 1
        queues = res[4 * len(sessions) : -1]
        delivered = {
            c: _delivered_ms(queues[2 * j], queues[2 * j + 1]) for j, c in enumerate(channels)
        }
        look = _Look([], [], {})
        for i, s in enumerate(sessions):
            first, held, private = res[4 * i], res[4 * i + 1] == 1, res[4 * i + 2] == 1
            folded = res[4 * i + 3] == 1  # the unified holder's to drain
            if isinstance(first, Exception) or not first:
                if not held and not private:
                    look.empty.append(s)
                else:
                    look.later[s] = now + recheck_ms
                continue
            first_ms = stream_id_ms(text(first[0][0]))
            if first_ms > now - in_flight_ms:  # its notification is on its way
                look.later[s] = first_ms + in_flight_ms
                continue
            look.later[s] = now + recheck_ms
            if held or _waiting(delivered[channel_of(s)], first_ms, now):
                continue
            # a stream folded under the held unified key is its holder's; one that is not in
            # its pending set (that set ran out while a re-notification of the key waited)
            # is re-notified: a duplicate is answered busy and joins the set
            if private or not unified or not unified_held or not folded:
                look.stranded.append(s)
        return look

    def _tidy_keys(self, s: str) -> list[str]:
        k = self.keys
        return [
            k.inbound(s),
            k.attempts(s),
            k.control_hint(s),
            k.lease(s),
            k.owner(s),
            k.queued(channel_of(s)),
        ]

    async def _now_ms(self) -> int:
        seconds, micros = await self.redis.time()
        return int(seconds) * 1000 + int(micros) // 1000

    # --- the janitor ----------------------------------------------------------------------
    async def keyspace(
        self, *, unified: bool, count: int = SCAN_COUNT, in_flight_ms: int = IN_FLIGHT_MS
    ) -> list[str]:
        """One SCAN step over every channel's inbound streams: malformed names deleted,
        empty streams forgotten, stranded ones re-notified (for frontends that do not
        write the index). Returns the re-notified sessions."""
        self._cursor, found = await self.bus.raw.scan(
            self._cursor, match=self.keys.inbound_pattern, count=count, _type="stream"
        )
        named = [(raw, strict_text(raw)) for raw in found]
        sessions = [s for s in (self.keys.session_of_inbound(n) if n else None for _, n in named)]
        junk = [raw for (raw, _), s in zip(named, sessions, strict=True) if not s]
        if junk:  # no session key names these streams: no worker could ever serve them
            log.warning("deleted %d inbound streams with malformed names", len(junk))
            await self.bus.raw.delete(*junk)
        valid = [s for s in sessions if s]
        if not valid:
            return []
        now = await self._now_ms()
        look = await self._look(valid, unified=unified, now=now, in_flight_ms=in_flight_ms)
        if look.empty:
            async with self.redis.pipeline(transaction=False) as pipe:
                for s in look.empty:
                    pipe.evalsha(script_sha("tidy"), 6, *self._tidy_keys(s), s)
                replies = await pipe.execute(raise_on_error=False)
            if any(isinstance(r, NoScriptError) for r in replies):
                await self.bus.scripts.load_all()
        for s in look.stranded:
            try:
                await self.bus.notify(s)
            except ResponseError as exc:  # that channel's ready queue is junk: its own loss
                await self.repair_ready(channel_of(s), str(exc))
        return look.stranded

    async def hints(self, *, count: int = SCAN_COUNT) -> int:
        """Delete control hints with no inbound stream beside them (a frontend's INCRBY
        for a session with nothing queued, or one whose stream ended): one SCAN step."""
        self._hint_cursor, found = await self.bus.raw.scan(
            self._hint_cursor, match=self.keys.hint_pattern, count=count
        )
        names = [(raw, strict_text(raw)) for raw in found]
        streams = [self.keys.inbound_of_hint(n) if n else None for _, n in names]
        junk = [raw for (raw, _), stream in zip(names, streams, strict=True) if not stream]
        if junk:  # no session's hint: nobody ever reads it
            await self.bus.raw.delete(*junk)
        pairs = [(raw, s) for (raw, _), s in zip(names, streams, strict=True) if s]
        if not pairs:
            return len(junk)
        async with self.bus.raw.pipeline(transaction=False) as pipe:
            for raw, stream in pairs:  # the check and the delete in one call
                pipe.evalsha(script_sha("hint"), 2, raw, stream)
            replies = await pipe.execute(raise_on_error=False)
        if any(isinstance(r, NoScriptError) for r in replies):
            await self.bus.scripts.load_all()
        return len(junk) + sum(1 for r in replies if r == 1)
