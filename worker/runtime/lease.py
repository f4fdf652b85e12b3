"""A held session lease: renewed in the background; losing it cancels the turn at once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from redis.exceptions import RedisError

from bus_redis import RedisBus

log = logging.getLogger(__name__)


class Lease:
    def __init__(self, bus: RedisBus, key: str, token: str, *, on_lost: Callable[[], None]) -> None:
        self.bus = bus
        self.key = key
        self.token = token
        self.lost = False
        self._on_lost = on_lost
        self._task: asyncio.Task[None] | None = None
        self._deadline = time.monotonic() + bus.lock_ttl_ms / 1000

    def start(self) -> Lease:
        self._task = asyncio.create_task(self._renew_forever(), name=f"lease:{self.key}")
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def mark_lost(self) -> None:
        if not self.lost:
            self.lost = True
            self._on_lost()

    async def _renew_forever(self) -> None:
        every_s = self.bus.lock_ttl_ms / 3000
        while not self.lost:
            await asyncio.sleep(every_s)
            started = time.monotonic()
            try:
                renewed = await self.bus.renew(self.key, self.token)
            except (RedisError, OSError) as exc:
                log.warning("lease renew of %s failed: %s", self.key, type(exc).__name__)
                if time.monotonic() >= self._deadline:
                    self.mark_lost()
                continue
            if not renewed:
                log.warning("lease of %s lost", self.key)
                self.mark_lost()
            else:
                self._deadline = started + self.bus.lock_ttl_ms / 1000
