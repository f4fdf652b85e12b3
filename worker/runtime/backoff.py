"""Exponential backoff for the reconnect loops (queue reads, the control subscription,
the worker's start, starting the job queue), and for the fenced writes a full Redis
refuses while their lease holds (``while_full``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis.exceptions import (
    AuthenticationError,
    BusyLoadingError,
    NoPermissionError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

T = TypeVar("T")

# what a start waits out: Redis full (maxmemory), loading its data, a replica while a
# failover promotes it, unreachable or slow. Anything else (a script refused, a wrong
# server) is a fault the operator must see at once.
TRANSIENT: tuple[type[BaseException], ...] = (
    OutOfMemoryError,
    BusyLoadingError,
    ReadOnlyError,
    RedisConnectionError,
    RedisTimeoutError,
    OSError,
)


class Backoff:
    def __init__(
        self, what: str, logger: logging.Logger, *, first_s: float = 0.05, cap_s: float = 2.0
    ) -> None:
        self.what = what
        self.log = logger
        self.first_s = first_s
        self.cap_s = cap_s
        self.delay_s = first_s

    def reset(self) -> None:
        self.delay_s = self.first_s

    async def after(self, exc: BaseException) -> None:
        """Log the failure, wait, and double the next wait (up to the cap)."""
        self.log.warning(
            "%s failed (%s); retrying in %.2fs", self.what, type(exc).__name__, self.delay_s
        )
        await asyncio.sleep(self.delay_s)
        self.delay_s = min(self.delay_s * 2, self.cap_s)

    async def until_done(
        self,
        action: Callable[[], Awaitable[object]],
        stopping: asyncio.Event,
        *,
        retry: tuple[type[BaseException], ...] = (RedisError, OSError),
    ) -> bool:
        """Run ``action`` until it returns (True), waiting with backoff after each error
        of ``retry`` (e.g. Redis refusing a connection at ``maxclients``), or until
        ``stopping`` is set (False). Wrong credentials or permissions are raised."""
        while not stopping.is_set():
            try:
                await action()
                return True
            except (AuthenticationError, NoPermissionError):
                raise
            except retry as exc:
                await self.after(exc)
        return False


async def while_full(
    what: str, logger: logging.Logger, holds: Callable[[], bool], op: Callable[[], Awaitable[T]]
) -> T:
    """``op()`` (a write fenced by a lease), tried again while Redis refuses it for memory
    (``OOM``: nothing written) and ``holds()`` (the lease): a full Redis is no failure of
    the work, nor of the message it is for. The refusal is raised once the lease is lost."""
    full = Backoff(what, logger, first_s=0.05, cap_s=1.0)
    while True:
        try:
            return await op()
        except OutOfMemoryError as exc:
            if not holds():
                raise
            await full.after(exc)
