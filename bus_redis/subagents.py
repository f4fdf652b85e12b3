"""SubagentStore: the Redis side of subagents (``worker.jobs.subagents`` runs them). A
session's running subagents are fields of one hash (at most a configured number); a
channel indexes the sessions that have some (``agent-worker status`` lists them). The
result goes into the session's stream only while the subagent is still registered: a
stop, discard or delete of the session unregisters them, and nothing comes back."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from redis.exceptions import WatchError

from bus_redis.codec import server_ms, text
from bus_redis.keys import channel_of
from bus_redis.streams import READY_MAXLEN, RedisBus

REGISTRATION_TTL_MS = 3_600_000  # a registration outlives any subagent's time limit


class SubagentStore:
    def __init__(self, bus: RedisBus) -> None:
        self.bus = bus
        self.keys = bus.keys
        self.redis = bus.raw

    async def add(
        self, lease_key: str, token: str, session: str, sid: str, doc: str, *, limit: int,
        channel_limit: int, scope: str, scope_limit: int,
    ) -> int:  # fmt: skip
        """1 added, 2 added already, 0 ``limit`` run in the session, -2 ``channel_limit``
        sessions of the channel have some running, -3 ``scope_limit`` of them are of
        ``scope``, -1 lease lost."""
        k, channel = self.keys, channel_of(session)
        keys = [k.lease(lease_key), k.spawned(session), k.subagents(channel)]
        keys.append(k.subagent_scopes(channel))
        args = [token, sid, doc, limit, REGISTRATION_TTL_MS, session, channel_limit]
        args += [scope, scope_limit]
        return int(text(await self.bus.scripts.call("spawn_add", keys, args)))

    async def _done(
        self,
        session: str,
        sid: str,
        op: str,
        doc: str = "",
        *,
        lease_key: str = "",
        token: str = "",
        run: str = "",
    ) -> int:
        k, channel = self.keys, channel_of(session)
        keys = [k.spawned(session), k.subagents(channel), k.inbound(session)]
        keys += [k.queued(channel), k.ready(channel)]
        keys.append(k.lease(lease_key) if token else keys[0])
        keys += [k.subagent_scopes(channel), k.owner(session)]
        args = [sid, op, doc, session, READY_MAXLEN, token, REGISTRATION_TTL_MS, run]
        return int(text(await self.bus.scripts.call("spawn_done", keys, args)))

    async def running(self, session: str, sid: str, doc: str) -> bool:
        """Record who runs it; False when it was aborted before it started."""
        return await self._done(session, sid, "running", doc) == 1

    async def finish(self, session: str, sid: str, payload: str, *, run: str = "") -> int:
        """Publish the result message: 1 published; 0 not, when it was aborted, or when
        ``run`` is given and the registration names another run; -3 not now (a private
        session is open on the session's key, or its opening waits in the stream: the
        result would be refused there), still registered (``put_off`` keeps it)."""
        return await self._done(session, sid, "done", payload, run=run)

    async def put_off(
        self, session: str, sid: str, payload: str, run: str, *, worker: str = ""
    ) -> int:
        """Keep a result that could not be published now in its registration (``finished``)
        for a later try; how many times it was put off (0: no longer registered, or
        another run's). ``worker``: the one whose job tries it again (named, so that a
        survivor of its death queues the try again)."""
        count = 0

        def finished(spec: dict[str, Any]) -> dict[str, Any] | None:
            nonlocal count
            if run and spec.get("run") != run:
                return None
            count = int(spec.get("put_off") or 0) + 1
            mine = {"worker": worker} if worker else {}
            return spec | {"state": "finished", "result": payload, "put_off": count} | mine

        # its slot in the channel's index is kept as long as it waits (the index drops a
        # session an hour after its spawn, and a private session may stay open longer)
        return count if await self._rewrite(session, sid, finished, renew=True) else 0

    async def drop(
        self, session: str, sid: str, *, lease_key: str = "", token: str = "", run: str = ""
    ) -> bool:
        """Unregister it; with ``token``, only while the turn dropping it still holds the
        lease of ``lease_key``, with ``run`` only while it names that run (False
        otherwise)."""
        done = await self._done(session, sid, "drop", lease_key=lease_key, token=token, run=run)
        return done == 1

    async def run_of(self, session: str, sid: str) -> str | None:
        """The run a registered subagent names ('' when none: not started, or claimed by a
        survivor and not started again yet); None when it is not registered."""
        raw = await self.redis.hget(self.keys.spawned(session), sid)  # type: ignore[misc]
        if raw is None:
            return None
        try:
            spec = json.loads(text(raw))
        except ValueError:
            return ""
        run = spec.get("run") if isinstance(spec, dict) else None
        return run if isinstance(run, str) else ""

    async def claim_orphan(self, session: str, sid: str, dead: str, me: str) -> bool:
        """Take a subagent registered as running on worker ``dead`` over for ``me``, at most
        once among every worker that judged ``dead`` dead (``WATCH``: the registration
        must still name ``dead``). Its job then runs again, started by the winner only."""

        def claimed(spec: dict[str, Any]) -> dict[str, Any] | None:
            if spec.get("worker") != dead or spec.get("state") != "running":
                return None
            # the run goes: the dead worker's, should it wake up, ends at its next look
            return {k: v for k, v in spec.items() if k != "run"} | {"worker": me}

        return await self._rewrite(session, sid, claimed)

    async def take_queued(self, session: str, sid: str, dead: str) -> bool:
        """Mark a subagent still ``queued`` as taken from worker ``dead`` (judged dead after
        its job queue took the job, before the job started it), with the server's time:
        should that worker wake up, the start of its job begun before is refused
        (``spawn_done.lua``) and the job's re-run goes on, wherever it runs (on that
        worker too). False when it is no longer queued (``WATCH``ed)."""

        seconds, micros = await self.redis.time()  # (the clock the jobs' starts read)
        at = int(seconds) * 1_000_000 + int(micros)

        def taken(spec: dict[str, Any]) -> dict[str, Any] | None:
            queued = spec.get("state") == "queued"
            return spec | {"taken_from": dead, "taken_us": at} if queued else None

        return await self._rewrite(session, sid, taken)

    async def _rewrite(
        self,
        session: str,
        sid: str,
        change: Callable[[dict[str, Any]], dict[str, Any] | None],
        *,
        renew: bool = False,
    ) -> bool:
        """Registration ``sid`` replaced by ``change(it)`` unless that is None or it changed
        meanwhile (``WATCH``); whether it was. ``renew``: the session's entry in its
        channel's index is dated now (only when it is there)."""
        key = self.keys.spawned(session)
        async with self.redis.pipeline(transaction=True) as pipe:
            try:
                await pipe.watch(key)
                raw = await pipe.hget(key, sid)  # type: ignore[misc]
                try:
                    spec = json.loads(text(raw)) if raw is not None else None
                except ValueError:
                    spec = None
                changed = change(spec) if isinstance(spec, dict) else None
                if changed is None:
                    return False
                now_ms = await server_ms(pipe) if renew else 0
                pipe.multi()
                pipe.hset(key, sid, json.dumps(changed))
                if renew:
                    index = self.keys.subagents(channel_of(session))
                    pipe.zadd(index, {session: now_ms}, xx=True)
                await pipe.execute()
            except WatchError:
                return False
        return True

    async def of_session(self, session: str) -> dict[str, str]:
        raw = await self.redis.hgetall(self.keys.spawned(session))  # type: ignore[misc]
        return {text(a): text(b) for a, b in raw.items()}

    async def sessions(self, channel: str, *, limit: int = 1000) -> list[str]:
        return [
            text(s) for s in await self.redis.zrange(self.keys.subagents(channel), 0, limit - 1)
        ]
