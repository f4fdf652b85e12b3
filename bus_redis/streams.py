"""RedisBus: everything a worker does on Redis besides session storage.

Reads session notifications from the shared ready queue (and its own inbox), takes and
renews fenced leases, selects entries, commits turns, forwards notifications to the owner
of a transient session, sweeps for dead lease holders. Replies are loosely typed at this
edge and decoded into the small dataclasses below; nothing above sees raw redis replies.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from bus_redis.codec import fields, text, texts
from bus_redis.keys import Keys
from bus_redis.results import (
    Acquired,
    AcquireResult,
    Busy,
    CommitSpec,
    Forward,
    Lost,
    Notification,
    Step,
    parse_step,
)
from bus_redis.scripts import Scripts

WORKER_GROUP = "workers"
READY_MAXLEN = 1_000_000
OUT_MAXLEN = 100_000


class RedisBus:
    """The worker's view of the Redis bus (SPEC 6: ``RedisBus(redis, prefix="agent")``)."""

    def __init__(
        self,
        redis: Redis,
        prefix: str = "agent",
        *,
        lock_ttl_ms: int = 10_000,
        owner_ttl_ms: int = 15_000,
    ) -> None:
        self.redis = redis
        self.keys = Keys(prefix)
        self.lock_ttl_ms = lock_ttl_ms
        self.owner_ttl_ms = owner_ttl_ms
        self._scripts = Scripts(redis)

    # --- queue ------------------------------------------------------------------
    async def ensure_groups(self, worker_id: str) -> None:
        for stream in (self.keys.ready, self.keys.inbox(worker_id)):
            try:
                await self.redis.xgroup_create(stream, WORKER_GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    async def read_notifications(
        self, worker_id: str, *, count: int, block_ms: int
    ) -> list[Notification]:
        streams: dict[Any, Any] = {self.keys.inbox(worker_id): ">", self.keys.ready: ">"}
        reply = await self.redis.xreadgroup(
            WORKER_GROUP,
            worker_id,
            streams,
            count=count,
            block=block_ms,
        )
        return [n for stream, entries in reply or [] for n in self._notes(text(stream), entries)]

    def _notes(self, stream: str, entries: Iterable[Any]) -> list[Notification]:
        out = []
        for entry_id, raw in entries:
            f = fields(raw)
            if f.get("session"):
                out.append(
                    Notification(
                        stream,
                        text(entry_id),
                        f["session"],
                        direct=f.get("direct") == "1",
                        effective=f.get("effective") == "1",
                    )
                )
        return out

    async def claim_stale(
        self, worker_id: str, *, min_idle_ms: int, count: int = 100
    ) -> list[Notification]:
        """Take over ready entries a dead consumer read but never acknowledged."""
        reply = await self.redis.xautoclaim(
            self.keys.ready, WORKER_GROUP, worker_id, min_idle_ms, "0-0", count=count
        )
        return self._notes(self.keys.ready, reply[1] if reply else [])

    async def ack(self, notes: Sequence[Notification]) -> None:
        if not any(n.entry_id for n in notes):
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            self._queue_ack(pipe, notes)
            await pipe.execute()

    @staticmethod
    def _queue_ack(pipe: Any, notes: Sequence[Notification]) -> None:
        for n in notes:
            if n.entry_id:  # synthetic notifications (owner self-check) have none
                pipe.xack(n.stream, WORKER_GROUP, n.entry_id)
                pipe.xdel(n.stream, n.entry_id)

    async def hand_back(self, worker_id: str, *, count: int = 1000) -> int:
        """Re-queue the ready entries delivered to us but not acknowledged (a blocking read
        cancelled at shutdown leaves them in our pending list) so others take them now."""
        ready = self.keys.ready
        pending = await self.redis.xpending_range(
            ready, WORKER_GROUP, min="-", max="+", count=count, consumername=worker_id
        )
        ids = [p["message_id"] for p in pending]
        if not ids:
            return 0
        entries = await self.redis.xclaim(ready, WORKER_GROUP, worker_id, 0, ids)
        async with self.redis.pipeline(transaction=True) as pipe:
            for entry_id, raw in entries:
                note: dict[Any, Any] = fields(raw)
                pipe.xadd(ready, note, maxlen=READY_MAXLEN, approximate=True)
                pipe.xack(ready, WORKER_GROUP, entry_id)
                pipe.xdel(ready, entry_id)
            await pipe.execute()
        return len(entries)

    async def forward(self, owner: str, note: Notification) -> None:
        """Hand a notification to the worker that owns the (transient) session."""
        await self.redis.xadd(self.keys.inbox(owner), {"session": note.session_key})

    async def notify(self, session_key: str, *, effective: bool = True) -> None:
        fields_: dict[Any, Any] = {"session": session_key, "effective": "1" if effective else "0"}
        await self.redis.xadd(self.keys.ready, fields_, maxlen=READY_MAXLEN, approximate=True)

    # --- leases ---------------------------------------------------------------------
    def _triples(self, members: Iterable[str]) -> tuple[list[str], list[str]]:
        keys: list[str] = []
        args: list[str] = []
        for m in members:
            keys += [self.keys.inbound(m), self.keys.attempts(m), self.keys.control_flag(m)]
            args.append(m)
        return keys, args

    async def acquire(
        self,
        key: str,
        worker_id: str,
        *,
        member: str = "",
        claim_owner: bool = False,
        select: bool = True,
        ack: Notification | None = None,
    ) -> AcquireResult:
        """Take the lease of ``key`` (see ``lua/acquire.lua``); ``ack`` is acknowledged in
        the same round trip."""
        k = self.keys
        tkeys, targs = self._triples([member] if member else [])
        keys = [k.lease(key), k.epoch(key), k.pending(key), k.owner(key), k.session(key)]
        keys += [k.leases, k.memory, *tkeys]
        args = [worker_id, self.lock_ttl_ms, key, member, "1" if claim_owner else "0"]
        args += [self.owner_ttl_ms, "1" if select else "0", *targs]
        if ack is None:
            parts = texts(await self._scripts.call("acquire", keys, args))
        else:
            async with self.redis.pipeline(transaction=False) as pipe:
                await self._scripts.call("acquire", keys, args, client=pipe)
                self._queue_ack(pipe, [ack])
                parts = texts((await pipe.execute())[0])
        if parts[0] == "forward":
            return Forward(parts[1])
        if parts[0] == "busy":
            return Busy(parts[1])
        return Acquired(parts[1], int(parts[2]), int(parts[3]), parse_step(parts[4:]))

    async def next(self, key: str, token: str, members: Iterable[str]) -> Step:
        tkeys, targs = self._triples(members)
        keys = [self.keys.lease(key), self.keys.pending(key), self.keys.leases, *tkeys]
        step = parse_step(texts(await self._scripts.call("next", keys, [token, key, *targs])))
        return step or Lost()

    async def peek(self, member: str, *, after: str, count: int) -> list[tuple[str, str]]:
        """Entries of one inbound stream after ``after`` (exclusive): ``(id, payload)``."""
        entries = await self.redis.xrange(self.keys.inbound(member), f"({after}", "+", count=count)
        return [(text(eid), fields(raw).get("payload", "")) for eid, raw in entries]

    async def renew(self, key: str, token: str) -> bool:
        keys = [self.keys.lease(key), self.keys.leases]
        return bool(await self._scripts.call("renew", keys, [token, self.lock_ttl_ms, key]))

    async def release(self, key: str, token: str) -> bool:
        """Give the lease up now; re-notify the key when streams are still pending."""
        k = self.keys
        keys = [k.lease(key), k.leases, k.ready, k.pending(key)]
        return bool(await self._scripts.call("release", keys, [token, key, READY_MAXLEN]))

    async def commit(
        self,
        key: str,
        token: str,
        worker_id: str,
        spec: CommitSpec,
        *,
        select: Iterable[str] | None,
    ) -> tuple[int, Step | None]:
        """Fenced commit; with ``select`` members, also picks the next entry or releases."""
        k = self.keys
        tkeys, targs = self._triples(select or [])
        keys = [k.lease(key), k.session(key), k.inbound(spec.member), k.attempts(spec.member)]
        keys += [k.out(spec.reply_channel or "_"), k.sessions_index, k.owner(key), k.owners]
        keys += [k.pending(key), k.leases, k.dead, *tkeys]
        args: list[Any] = [token, " ".join(spec.entry_ids), spec.reply, OUT_MAXLEN, spec.meta]
        args += [key, spec.owner_op, worker_id, spec.owner_member, self.owner_ttl_ms, spec.dead]
        args += ["1" if select is not None else "0", len(spec.rows), *spec.rows, *targs]
        parts = texts(await self._scripts.call("commit", keys, args))
        if parts[0] == "lost":
            return -1, Lost()
        return int(parts[1]), parse_step(parts[2:])

    async def emit(self, key: str, token: str, channel: str, payload: str) -> bool:
        keys = [self.keys.lease(key), self.keys.out(channel)]
        return bool(await self._scripts.call("emit", keys, [token, payload, OUT_MAXLEN]))

    async def sweep(self, *, limit: int = 100) -> list[str]:
        """Re-notify keys whose lease expired without release (their holder died)."""
        keys = [self.keys.leases, self.keys.ready]
        return texts(await self._scripts.call("sweep", keys, [limit, READY_MAXLEN]))

    # --- transient owners -----------------------------------------------------------
    async def renew_owner(self, key: str, worker_id: str, member: str) -> bool:
        keys = [self.keys.owner(key), self.keys.owners]
        args = ["renew", worker_id, member, self.owner_ttl_ms]
        return bool(await self._scripts.call("owner", keys, args))

    async def drop_owner(self, key: str, worker_id: str, member: str) -> None:
        keys = [self.keys.owner(key), self.keys.owners]
        await self._scripts.call("owner", keys, ["drop", worker_id, member, 0])

    async def unserved(self, keys: Sequence[str]) -> list[str]:
        """Those of ``keys`` with queued inbound entries and no lease holder."""
        if not keys:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.xlen(self.keys.inbound(key))
                pipe.exists(self.keys.lease(key))
            res = await pipe.execute()
        return [k for i, k in enumerate(keys) if int(res[2 * i]) > 0 and not int(res[2 * i + 1])]

    async def abandon_owner(self, key: str, worker_id: str) -> None:
        """Delete our owner record but keep its registry entry, so that
        :meth:`report_owner_lost` tells the frontend."""
        keys = [self.keys.owner(key), self.keys.owners]
        await self._scripts.call("owner", keys, ["abandon", worker_id, "", 0])

    async def due_owners(self, *, limit: int = 100) -> list[str]:
        now_ms = int(time.time() * 1000)
        return texts(await self.redis.zrangebyscore(self.keys.owners, "-inf", now_ms, 0, limit))

    async def report_owner_lost(self, member: str, event_json: str) -> bool:
        key, channel, _chat = json.loads(member)
        k = self.keys
        keys = [k.owner(key), k.owners, k.out(channel), k.ready]
        return bool(
            await self._scripts.call("owner_lost", keys, [member, event_json, key, OUT_MAXLEN])
        )

    # --- workers ----------------------------------------------------------------------
    async def heartbeat(self, worker_id: str, info: dict[str, str], ttl_ms: int) -> None:
        now_ms = int(time.time() * 1000)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zadd(self.keys.workers, {worker_id: now_ms})
            pipe.hset(self.keys.worker_info(worker_id), mapping=info)
            pipe.pexpire(self.keys.worker_info(worker_id), ttl_ms)
            await pipe.execute()

    async def leave(self, worker_id: str) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zrem(self.keys.workers, worker_id)
            pipe.delete(self.keys.worker_info(worker_id), self.keys.inbox(worker_id))
            await pipe.execute()
