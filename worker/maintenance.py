"""Periodic work of a worker: heartbeat, transient-owner renewal, and recovery of
sessions whose lease holder or transient owner died."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError

from bus_redis import OutboundMessage
from bus_redis.codec import parse_flag, text
from bus_redis.results import Notification

if TYPE_CHECKING:
    from worker.loop import AgentLoop

log = logging.getLogger(__name__)


class Maintenance:
    def __init__(self, loop: AgentLoop) -> None:
        self.loop = loop
        self.bus = loop.bus
        self._tasks: set[asyncio.Task[Any]] = set()
        self.started_ms = int(time.time() * 1000)

    @property
    def every_s(self) -> float:
        return self.bus.lock_ttl_ms / 3000

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def run(self) -> None:
        while True:
            try:
                await self.tick()
            except (RedisError, OSError) as exc:
                log.warning("maintenance skipped: %s", type(exc).__name__)
            await asyncio.sleep(self.every_s)

    async def tick(self) -> None:
        loop = self.loop
        info = {
            "host": socket.gethostname(),
            "pid": str(os.getpid()),
            "started_ms": str(self.started_ms),
            "active": str(len(loop.active_tasks)),
            "transient": str(len(loop.owned)),
            **{name: str(count) for name, count in loop.metrics.items()},
        }
        await self.bus.heartbeat(loop.worker_id, info, ttl_ms=self.bus.lock_ttl_ms * 3)
        for key, member in list(loop.owned.items()):
            if not await self.bus.renew_owner(key, loop.worker_id, member):
                log.warning("owner record of a transient session expired; session dropped")
                loop.forget(key)
        await self.check_owned()
        for key in await self.bus.sweep():
            log.info("lease of %s expired without release; re-notified", key)
        stale = await self.bus.claim_stale(loop.worker_id, min_idle_ms=self.bus.lock_ttl_ms)
        if stale:
            log.info("claimed %d unacknowledged notifications of dead consumers", len(stale))
            loop.dispatch(stale)
        for member in await self.bus.due_owners():
            await self.bus.report_owner_lost(member, self._lost_event(member))

    async def check_owned(self) -> None:
        """Serve our transient sessions that have messages but no notification reached
        us (a forwarding worker died between its acquire and its forward)."""
        inbox = self.bus.keys.inbox(self.loop.worker_id)
        for key in await self.bus.unserved(list(self.loop.owned)):
            if key not in self.loop.holders:
                self.loop.dispatch([Notification(inbox, "", key)])

    @staticmethod
    def _lost_event(member: str) -> str:
        import json

        key, channel, chat_id = json.loads(member)
        if not channel:
            return ""
        out = OutboundMessage(
            type="error",
            channel=channel,
            chat_id=chat_id,
            session_key=key,
            code="session_lost",
            content="the worker holding this private session is gone",
        )
        return out.model_dump_json(exclude_none=True)

    async def drop_owner(self, key: str, member: str) -> None:
        await self.bus.drop_owner(key, self.loop.worker_id, member)

    async def read_flags(self, keys: list[str]) -> dict[str, str]:
        """Control flags newer than the turn (or ownership) they would cancel."""
        if not keys:
            return {}
        raw = await self.bus.redis.mget([self.bus.keys.control_flag(k) for k in keys])
        found: dict[str, str] = {}
        for key, value in zip(keys, raw, strict=True):
            flag = parse_flag(text(value))
            if flag is not None and flag[2] >= self.loop.since_ms.get(key, 0):
                found[key] = flag[0]
        return found

    async def leave(self) -> None:
        """On shutdown: our transient sessions die with us; tell their frontends now."""
        for key, member in list(self.loop.owned.items()):
            try:
                await self.bus.abandon_owner(key, self.loop.worker_id)
                await self.bus.report_owner_lost(member, self._lost_event(member))
            except (RedisError, OSError):
                log.warning("could not report a transient session as lost")
            self.loop.sessions.invalidate(key)
        self.loop.owned.clear()
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=2)
        try:
            handed = await self.bus.hand_back(self.loop.worker_id)
            if handed:
                log.info("handed %d unserved notifications back to the queue", handed)
            await self.bus.leave(self.loop.worker_id)
        except (RedisError, OSError):
            log.warning("could not deregister worker %s", self.loop.worker_id)
