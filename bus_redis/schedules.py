"""ScheduleStore: the Redis side of scheduled turns (``worker.jobs.schedules`` decides the
times). A channel keeps its schedules' definitions in one hash and their next firings in
one sorted set; a session keeps the ids of its own (at most a configured number, deleted
with it). Every write is one script: add (fenced by the adding turn's lease), remove, and
fire, which publishes the firing into the session's stream and moves the schedule on in
one step, so a firing is delivered once whichever worker comes first.
"""

from __future__ import annotations

from typing import Any

from bus_redis.codec import text
from bus_redis.keys import channel_of
from bus_redis.streams import READY_MAXLEN, RedisBus


class ScheduleStore:
    def __init__(self, bus: RedisBus) -> None:
        self.bus = bus
        self.keys = bus.keys
        self.redis = bus.raw

    async def add(
        self, lease_key: str, token: str, session: str, sid: str, doc: str, first_ms: int,
        *, limit: int, channel_limit: int, scope: str, scope_limit: int,
    ) -> int:  # fmt: skip
        """1 added, 2 added already, 0 the session has ``limit`` schedules, -2 the channel
        has ``channel_limit``, -3 the sessions of ``scope`` have ``scope_limit``, -1 lease
        lost."""
        k, channel = self.keys, channel_of(session)
        keys = [k.lease(lease_key), k.cron_defs(channel), k.cron_due(channel), k.crons(session)]
        keys += [k.cron_scope_of(channel), k.cron_per_scope(channel)]
        args = [token, sid, doc, first_ms, limit, channel_limit, scope, scope_limit]
        return int(text(await self.bus.scripts.call("cron_add", keys, args)))

    async def remove(self, session: str, sid: str, *, lease_key: str = "", token: str = "") -> bool:
        """Remove a schedule of ``session``; with ``token``, only while the turn removing
        it still holds the lease of ``lease_key`` (False otherwise)."""
        return int(text(await self._remove(session, sid, lease_key, token, ""))) == 1

    async def take(
        self, session: str, sid: str, *, lease_key: str = "", token: str = ""
    ) -> tuple[int, str, int | None]:
        """``remove``, with what it removed: ``(1, definition, next firing ms or None)``,
        ``(0, "", None)`` no such schedule, ``(-1, "", None)`` lease lost."""
        reply = await self._remove(session, sid, lease_key, token, "1")
        if not isinstance(reply, list):
            return int(text(reply)), "", None
        due = text(reply[2])
        return int(text(reply[0])), text(reply[1]), int(float(due)) if due else None

    async def _remove(self, session: str, sid: str, lease_key: str, token: str, taken: str) -> Any:
        k, channel = self.keys, channel_of(session)
        keys = [k.cron_defs(channel), k.cron_due(channel), k.crons(session)]
        keys.append(k.lease(lease_key) if token else keys[2])
        keys += [k.cron_scope_of(channel), k.cron_per_scope(channel)]
        return await self.bus.scripts.call("cron_remove", keys, [sid, token, "", taken])

    async def purge(self, channel: str, sid: str) -> None:
        """Drop an unreadable definition (its session's set keeps the id until an add finds
        the set full: ``cron_add.lua`` drops ids without a definition then)."""
        k = self.keys
        keys = [k.cron_defs(channel), k.cron_due(channel), k.cron_defs(channel)]
        keys += [k.cron_defs(channel), k.cron_scope_of(channel), k.cron_per_scope(channel)]
        await self.bus.scripts.call("cron_remove", keys, [sid, "", "1", ""])

    async def fire(
        self,
        session: str,
        key: str,
        sid: str,
        due_ms: int,
        payload: str,
        next_ms: int | None,
        *,
        retry_ms: int,
    ) -> int:
        """1 fired, 0 not due at ``due_ms`` any more (or dropped: its session was never
        stored), -2 moved on without a message, -3 not now, put off to ``retry_ms`` (its
        first turn still runs, or waits to be run again after its worker died; a private
        session is open on its key).
        ``key``: the session's effective key (its hash and lease; a private session is
        looked for on ``session``, the stream the firing goes to)."""
        k, channel = self.keys, channel_of(session)
        keys = [k.cron_defs(channel), k.cron_due(channel), k.crons(session)]
        keys += [k.inbound(session), k.queued(channel), k.ready(channel)]
        keys += [k.session(key), k.lease(key), k.journal(key)]
        keys += [k.cron_scope_of(channel), k.cron_per_scope(channel), k.owner(session)]
        nxt = "" if next_ms is None else next_ms
        args = [sid, due_ms, payload, nxt, session, READY_MAXLEN, max(retry_ms, due_ms + 1)]
        args.append("1" if key != session else "")  # (folded: unified mode)
        return int(text(await self.bus.scripts.call("cron_fire", keys, args)))

    async def of_session(self, session: str) -> list[tuple[str, str, int | None]]:
        """``(id, definition JSON, next firing ms)`` of a session's schedules."""
        k, channel = self.keys, channel_of(session)
        ids = sorted(text(i) for i in await self.redis.smembers(k.crons(session)))  # type: ignore[misc]
        return await self.read(channel, ids)

    async def read(self, channel: str, ids: list[str]) -> list[tuple[str, str, int | None]]:
        if not ids:
            return []
        k = self.keys
        docs = await self.redis.hmget(k.cron_defs(channel), ids)  # type: ignore[misc]
        out = []
        for sid, doc in zip(ids, docs, strict=True):
            if doc is None:
                continue
            due = await self.redis.zscore(k.cron_due(channel), sid)
            out.append((sid, text(doc), None if due is None else int(due)))
        return out

    async def all_of(self, channel: str, *, limit: int = 1000) -> list[tuple[str, str, int | None]]:
        """A channel's schedules, soonest first (operators' ``cron list``)."""
        ids = [text(i) for i in await self.redis.zrange(self.keys.cron_due(channel), 0, limit - 1)]
        return await self.read(channel, ids)

    async def due(self, channel: str, now_ms: int, *, limit: int) -> list[tuple[str, int]]:
        """At most ``limit`` schedules of ``channel`` due by ``now_ms``, the most overdue first."""
        rows = await self.redis.zrangebyscore(
            self.keys.cron_due(channel), "-inf", now_ms, start=0, num=limit, withscores=True
        )
        return [(text(sid), int(score)) for sid, score in rows]

    async def due_between(
        self, channel: str, after_ms: int, until_ms: int, *, limit: int
    ) -> list[tuple[str, int]]:
        """At most ``limit`` schedules of ``channel`` due in ``(after_ms, until_ms]``."""
        rows = await self.redis.zrangebyscore(
            self.keys.cron_due(channel), f"({after_ms}", until_ms, start=0, num=limit,
            withscores=True,
        )  # fmt: skip
        return [(text(sid), int(score)) for sid, score in rows]

    async def definition(self, channel: str, sid: str) -> str | None:
        doc = await self.redis.hget(self.keys.cron_defs(channel), sid)  # type: ignore[misc]
        return None if doc is None else text(doc)
