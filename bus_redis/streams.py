"""RedisBus: everything a worker does on Redis besides session storage.

Reads session notifications from the channels' ready queues and its own inbox (the
``ReadyQueues`` part, in ``bus_redis.queue``), takes and renews fenced leases, selects
entries, commits turns, emits events. Replies are loosely typed at this edge and decoded into the
small dataclasses of ``results``; nothing above sees raw redis replies. Sweeps and the
owner / worker registries are in ``bus_redis.registry``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.client import NEVER_DECODE

from bus_redis.codec import fresh_nonce, payload_text, text, texts
from bus_redis.keys import Keys, channel_of
from bus_redis.mux import Multiplexed
from bus_redis.queue import READY_MAXLEN, WORKER_GROUP, ReadyQueues
from bus_redis.results import (
    Acquired,
    AcquireResult,
    Ahead,
    Busy,
    Cached,
    CommitSpec,
    ControlReached,
    Fold,
    Forward,
    Gone,
    Late,
    Lost,
    More,
    Notification,
    Private,
    Step,
    parse_step,
)
from bus_redis.scripts import Scripts
from bus_redis.turn_keys import ChannelNames, TurnKeys, TurnNames

__all__ = ["READY_MAXLEN", "WORKER_GROUP", "RedisBus", "Retention"]

HISTORY_MAXLEN = 10_000  # dated consolidation entries kept per scope
MARK_KEEP_MS = 90 * 86_400_000  # a private mark's life past its session when sessions stay
PRIVATE_END_KEEP_MS = 86_400_000  # a private session's end (per-session mode): a day
PULSE_MAXLEN = 10_000  # pulses a channel keeps (the scripts say it too)
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Retention:
    """How long and how much of a session's events are kept for (re)readers."""

    maxlen: int = 1000
    ttl_ms: int = 3_600_000
    transient_ttl_ms: int = 60_000
    # how long an idle durable session is kept (AGENT_SESSION_TTL_S; 0: for good): a
    # private session's mark outlives it this long, a scope's archive keeps entries so long
    session_ttl_ms: int = 90 * 86_400_000


class RedisBus(ReadyQueues, TurnKeys):
    """The worker's view of the Redis bus: ``RedisBus(redis, prefix="agent")``."""

    def __init__(
        self,
        redis: Redis,
        prefix: str = "agent",
        *,
        lock_ttl_ms: int = 10_000,
        owner_ttl_ms: int = 15_000,
        retention: Retention | None = None,
    ) -> None:
        self.redis = redis
        self.keys = Keys(prefix)
        self.lock_ttl_ms = lock_ttl_ms
        self.owner_ttl_ms = owner_ttl_ms
        self.retention = retention or Retention()
        self.marks_private = False  # unified mode: private sessions' keys are marked
        # the turn path's commands share one pipelined connection (bus_redis.mux)
        self.fast = Multiplexed.for_client(redis)
        self.scripts = Scripts(redis, self.fast)
        # the blocking read of the ready queues has a connection of its own (a blocked
        # command would hold up every command behind it on ``fast``)
        self.reader = Multiplexed.for_client(redis) if self.fast is not None else None
        self._raw: Redis | None = None
        self._names: dict[str, TurnNames] = {}
        self._channels: dict[str, ChannelNames] = {}

    async def aclose(self) -> None:
        """Close what the bus opened itself (the twin client, the multiplexed connection),
        not the client it was given."""
        if self.fast is not None:
            await self.fast.aclose()
        if self.reader is not None:
            await self.reader.aclose()
        if self._raw is not None:
            raw, self._raw = self._raw, None
            await raw.aclose()
            await raw.connection_pool.disconnect()

    # --- leases ---------------------------------------------------------------------
    def _streams(self, members: Iterable[str]) -> tuple[list[str], list[str]]:
        keys: list[str] = []
        args: list[str] = []
        for m in members:
            keys += self.names(m).stream
            args.append(m)
        return keys, args

    async def acquire(
        self,
        key: str,
        worker_id: str,
        *,
        member: str = "",
        claim_owner: bool = False,
        held_owner: bool = False,
        select: bool = True,
        note: Notification | None = None,
        memory_key: str = "",
        cached: Cached | None = None,
        fold: str = "",
    ) -> AcquireResult:
        """Take the lease of ``key`` (see ``lua/acquire.lua``); ``note`` is acknowledged
        inside the script, only once it succeeded. With ``cached`` (the worker's copy of
        the durable session), a copy that is behind gets the rows it lacks in the same call
        (``Acquired.ahead``). ``fold``: the key streams are folded under (unified mode), so
        that a stream's own acquire answers busy while that key's holder has it pending."""
        skeys, sargs = self._streams([member] if member and select else [])
        n = self.names(key)
        s = self.names(member) if member else n
        keys = [n.lease, n.pending, n.session, memory_key or n.session, s.owner]
        keys += [note.stream if note and note.entry_id else n.lease, n.channel.leases, s.lease]
        if fold and key == member and key != fold:
            f = self.names(fold)
            keys += [f.lease, f.pending]
        else:
            keys += [n.lease, n.pending]  # nothing folded to look at
        owner = "1" if claim_owner else "2" if held_owner else "0"
        args: list[Any] = [worker_id, self.lock_ttl_ms, key, member, owner]
        nonce = fresh_nonce()
        args += [self.owner_ttl_ms, "1" if select else "0", nonce, READY_MAXLEN]
        args += [note.entry_id if note else "", WORKER_GROUP]
        if cached is None:
            args += [0, 0, "", 0]
        else:
            args += [cached.rows, cached.ahead, cached.generation, cached.version]
        raw = await self.scripts.call("acquire", keys + skeys, args + sargs)
        parts = texts(raw[:5])
        if parts[0] == "gone":
            return Gone()
        if parts[0] == "private":
            return Private()
        if parts[0] == "fold":
            return Fold()
        if parts[0] == "forward":
            return Forward(parts[1])
        if parts[0] == "busy" and parts[1] == f"{nonce}|{worker_id}":
            # a client retry of a call that did run (its reply was lost): the lease is ours;
            # versions unknown (-1: reload), the step is found again with next()
            return Acquired(parts[1], -1, "", -1, More((member,) if member else ()))
        if parts[0] == "busy":
            return Busy(parts[1])
        version, gen, memory = int(parts[2]), parts[3], int(parts[4])
        ahead = None
        if cached is not None and raw[5]:
            meta, count, *rows = raw[5]
            ahead = Ahead(
                cached.rows, version, gen, text(meta or b""), int(count or 0), tuple(rows)
            )
        return Acquired(parts[1], version, gen, memory, parse_step(raw[6:]), ahead)

    async def next(
        self, key: str, token: str, members: Iterable[str], *, done: ControlReached | None = None
    ) -> Step:
        """The next step of a held key; ``done``: a new or delete marker the holder acted
        on, consumed first (its stream must be among ``members``)."""
        skeys, sargs = self._streams(members)
        k = self.keys
        keys = [k.lease(key), k.pending(key), k.leases(channel_of(key)), *skeys]
        marker = [done.member, done.marker] if done is not None and done.marker else ["", ""]
        reply = await self.scripts.call("next", keys, [token, key, READY_MAXLEN, *marker, *sargs])
        return parse_step(reply) or Lost()

    async def peek(self, member: str, *, after: str, count: int) -> list[tuple[str, str | None]]:
        """Entries of one inbound stream after ``after`` (exclusive): ``(id, payload)``;
        the payload is None for a control marker."""
        stream = self.keys.inbound(member)
        command = ("XRANGE", stream, f"({after}", "+", "COUNT", count)
        if self.fast is not None:
            entries = await self.fast.execute(*command)
        else:
            entries = await self.redis.execute_command(*command, **{NEVER_DECODE: True})
        out: list[tuple[str, str | None]] = []
        for eid, raw in entries or []:
            pairs = raw if isinstance(raw, dict) else dict(zip(raw[::2], raw[1::2], strict=True))
            payload = pairs.get(b"payload")
            out.append((text(eid), None if payload is None else payload_text(payload)))
        return out

    async def renew(self, key: str, token: str) -> bool:
        k = self.keys
        keys = [k.lease(key), k.pending(key), k.leases(channel_of(key))]
        return bool(await self.scripts.call("renew", keys, [token, self.lock_ttl_ms, key]))

    async def release(self, key: str, token: str, *, done: ControlReached | None = None) -> bool:
        """Give the lease up now; re-notify the key when streams are still pending.
        ``done``: a new or delete marker at the head of K's own stream the holder acted
        on, consumed first."""
        keys = self.keys.release(key, self.keys.lease(key))
        marker = done.marker if done is not None and done.member == key else ""
        args = [token, key, READY_MAXLEN, marker]
        return bool(await self.scripts.call("release", keys, args))

    async def commit(
        self,
        key: str,
        token: str,
        worker_id: str,
        spec: CommitSpec,
        *,
        select: Iterable[str] | None,
    ) -> tuple[int, str, Step | Late | None]:
        """Fenced commit; with ``select`` members, also picks the next entry or releases.
        Returns ``(version, generation, step)``; version -1 when nothing was written: the
        lease was lost (``Lost``) or a message arrived after ``spec.late_after`` (``Late``)."""
        r = self.retention
        skeys, sargs = self._streams(select or [])
        n, m = self.names(key), self.names(spec.member)
        index = n.channel.sessions_index
        scope = self.keys.scope_sessions(spec.scope) if spec.scope else index
        keys = [n.lease, n.session, m.inbound, m.attempts, m.out, index, scope, m.owner]
        keys += [m.channel.owners, n.pending, m.channel.dead, n.channel.leases, n.journal]
        keys.append(m.channel.pulse)
        ttl = r.transient_ttl_ms if spec.transient else r.ttl_ms
        args: list[Any] = [token, " ".join(spec.entry_ids), spec.reply, r.maxlen, ttl, spec.meta]
        args += [key, spec.owner_op, worker_id, spec.owner_member, self.owner_ttl_ms, spec.dead]
        mode = ("1" if select is not None else "0") + ("j" if spec.journaled else "-")
        mode += "p" if spec.transient else ""
        args += [mode, fresh_nonce(), spec.late_after]
        args += [len(spec.rows), *spec.rows, *sargs]
        # a cancelled turn's commit carries the `cancelled` event a stop waits for: sent at
        # once, not at the end of a busy event loop's iteration
        raw = await self.scripts.call("commit", keys + skeys, args, now=spec.outcome == "cancelled")
        parts = texts(raw[:3])
        if parts[0] == "lost":
            return -1, "", Lost()
        if parts[0] == "late":
            return -1, "", Late()
        return int(parts[1]), parts[2], parse_step(raw[3:])

    @property
    def private_mark_ms(self) -> int:
        """How long a private session's mark outlives it (see ``Keys.private_mark``): as
        long as an idle durable session is kept, 90 days when those are kept for good; 0:
        no marks (only the unified mode reads them)."""
        if not self.marks_private:
            return 0
        return self.retention.session_ttl_ms or MARK_KEEP_MS

    @property
    def private_end_ms(self) -> int:
        """How long the end of a private session is kept (``Keys.private_end``): a ``new``
        marker of it waits that long at most to be a discard. 0 in unified mode, whose
        marks outlive private sessions."""
        return 0 if self.marks_private else PRIVATE_END_KEEP_MS

    async def mark_private(self, member: str) -> None:
        """Mark stream ``member`` as a private session's before its opening is handled; a
        mark left by an opening that came to nothing makes only a ``new`` a discard."""
        ms = self.private_mark_ms
        if ms:
            await self.redis.set(self.keys.private_mark(member), "1", px=ms + self.owner_ttl_ms)

    async def emit(
        self, key: str, token: str, member: str, payload: str, *, transient: bool
    ) -> bool:
        r = self.retention
        keys = [self.keys.lease(key), self.keys.out(member), self.keys.pulse(channel_of(member))]
        ttl = r.transient_ttl_ms if transient else r.ttl_ms
        return bool(await self.scripts.call("emit", keys, [token, payload, r.maxlen, ttl]))

    async def compact_private(self, key: str, token: str, member: str, *, limit: int = 64) -> int:
        """Rewrite a private session's events with only the live ones (see
        ``lua/compact.lua``); -1 when skipped."""
        keys = [self.keys.lease(key), self.keys.out(member)]
        return int(text(await self.scripts.call("compact", keys, [token, limit])))

    async def consolidate(
        self,
        key: str,
        token: str,
        *,
        meta: str,
        version: int,
        scope: str,
        memory: str,
        memory_version: int,
        history: str,
    ) -> str:
        """Under the lease: replace the scope's memory (if it is still at
        ``memory_version``), archive ``history``, store ``meta``. ``'ok'``, ``'moved'``
        (the session changed), ``'memory_moved'`` (fold again) or ``'lost'``."""
        k = self.keys
        keys = [k.lease(key), k.session(key), k.memory(scope), k.memory_history(scope)]
        args = [token, meta, version, memory, memory_version, history, HISTORY_MAXLEN]
        args.append(self.retention.session_ttl_ms)
        return texts(await self.scripts.call("consolidate", keys, args))[0]

    async def delete_session(self, key: str, token: str, scope: str) -> int:
        keys = self.keys.deletion(key, self.keys.lease(key), scope)
        return int(text(await self.scripts.call("delete", keys, [token, key])))
