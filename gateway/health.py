"""``/readyz``: can this replica reach Redis. Anyone may ask (no credentials), so Redis is
asked at most once a second whatever the rate of asking: concurrent callers share one
``PING``, and an answer is reused for ``max_age_s``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from redis.asyncio import Redis
from redis.exceptions import RedisError

PING_TIMEOUT_S = 2.0


class Readiness:
    def __init__(
        self, redis: Redis, *, max_age_s: float = 1.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.redis, self.max_age_s, self.clock = redis, max_age_s, clock
        self._answer: tuple[float, bool] | None = None  # (when, ready)
        self._asking: asyncio.Task[bool] | None = None
        self.pings = 0

    async def ready(self) -> bool:
        if self._answer is not None and self.clock() - self._answer[0] < self.max_age_s:
            return self._answer[1]
        if self._asking is None:
            self._asking = asyncio.ensure_future(self._ping())
            self._asking.add_done_callback(self._asked)
        return await asyncio.shield(self._asking)  # a caller that gives up cancels no one

    async def _ping(self) -> bool:
        """A ``PING`` that answers within ``PING_TIMEOUT_S``: one sent on a connection whose
        peer vanished silently (a failover, a dropped flow) is given up (redis-py drops
        that connection) instead of holding every later ``/readyz`` with it."""
        self.pings += 1
        try:
            async with asyncio.timeout(PING_TIMEOUT_S):
                await self.redis.ping()
        except (RedisError, OSError, TimeoutError):
            return False
        return True

    def _asked(self, task: asyncio.Task[bool]) -> None:
        self._asking = None
        if not task.cancelled() and task.exception() is None:
            self._answer = (self.clock(), task.result())
