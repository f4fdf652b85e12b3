"""How often one user may ask a replica for anything: a token bucket per user.

The backlog bound (gateway.backlog) limits what a user leaves waiting in Redis; it does
not limit how often a user asks. Every request that reaches a route costs the replica
and Redis work (a refused send still runs its checking transaction; a subscription reads
a stream), so a user who floods, by a script or by clicking, slows every other user of
the replica. Here each authenticated request (and each WebSocket subscription) takes one
token from its user's bucket: ``rate`` tokens a second, at most ``burst`` saved up.

A request without a token is not answered at once, since a refusal that costs nothing
to get is what lets a flood fill the process: a client asking again as soon as it is
refused would get thousands of answers a second, each parsed, routed and answered on
the event loop every user shares (bench/flood.py measured the other user's p50 at ~37
ms, from ~2 ms, with immediate refusals). Instead, a request that would have a token
within ``max_delay_s`` reserves it and waits for it (the user is slowed down, not
refused); one that would not waits half to all of ``max_delay_s`` (refusals due at the
same time spread out) and gets 429 with ``Retry-After``.
Waiting holds a coroutine and no CPU, so one connection asks at most ``rate`` plus one
refused request a ``max_delay_s``; how many connections one client opens is for the
reverse proxy in front (docs/SECURITY.md).

The bound is per replica: N replicas admit at most N x ``rate`` requests a second of one
user (a shared count would cost a Redis call on every request, the work this saves). The
buckets take memory for the users seen lately only: past ``max_users`` buckets, those
refilled (the same as none) are dropped, then the least recently used.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable

MAX_USERS = 10_000  # buckets kept per replica before the refilled ones are dropped
MAX_DELAY_S = 1.0  # the longest a request waits for its token, or before its 429


class UserRate:
    def __init__(
        self,
        rate: float,
        burst: int,
        *,
        max_delay_s: float = MAX_DELAY_S,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
        max_users: int = MAX_USERS,
    ) -> None:
        self.rate, self.burst, self.max_delay_s = rate, burst, max_delay_s
        self.clock, self.sleep, self.max_users = clock, sleep, max_users
        # user -> (tokens, at); below 0: tokens reserved by waiting requests. LRU order.
        self._buckets: dict[str, tuple[float, float]] = {}

    async def wait(self, user: str, cost: float = 1.0) -> bool:
        """Wait for ``cost`` of ``user``'s tokens (one a request; more for a large body):
        True once they are there (at once, or after up to ``max_delay_s``); False, after
        ``max_delay_s``, when they would not be there by then."""
        delay = self.admit(user, cost)
        if delay is None:  # a half to a whole max_delay_s: refusals due at once spread out
            await self.sleep(self.max_delay_s * (0.5 + random.random() / 2))
            return False
        if delay > 0:
            await self.sleep(delay)
        return True

    def admit(self, user: str, cost: float = 1.0) -> float | None:
        """The seconds until ``user`` has ``cost`` tokens (0: now; at most ``burst``),
        reserved for the caller; None when that is further off than ``max_delay_s``
        (nothing reserved)."""
        if self.rate <= 0:
            return 0.0
        cost = max(1.0, min(cost, float(self.burst)))
        now = self.clock()
        tokens, at = self._level(user, now)
        self._buckets.pop(user, None)  # put back last: the most recently used
        delay: float | None = 0.0 if tokens >= cost else (cost - tokens) / self.rate
        if delay is not None and delay > self.max_delay_s:
            delay = None
        # (most recent last; the time never goes back, so a clock stepped back and then
        # forward gives no free refill)
        self._buckets[user] = (tokens - cost if delay is not None else tokens, max(at, now))
        if len(self._buckets) > self.max_users:
            self._prune(now)
        return delay

    def refund(self, user: str, tokens: float) -> None:
        """Tokens taken for a request that was refused after all (the rest of its cost
        could not be had): given back, up to the burst."""
        if self.rate <= 0 or user not in self._buckets:
            return
        level, at = self._level(user, self.clock())
        self._buckets[user] = (min(float(self.burst), level + tokens), max(at, self.clock()))

    def retry_after_s(self, user: str, cost: float = 1.0) -> float:
        """When asking again may get ``cost`` tokens without waiting (``Retry-After``)."""
        if self.rate <= 0:
            return 0.0
        cost = max(1.0, min(cost, float(self.burst)))
        tokens, _ = self._level(user, self.clock())
        return max(0.0, (cost - tokens) / self.rate)

    def _level(self, user: str, now: float) -> tuple[float, float]:
        """``user``'s tokens now (refilled since, up to the burst) and the bucket's time;
        a user without a bucket gets a full one."""
        tokens, at = self._buckets.get(user, (float(self.burst), now))
        return min(float(self.burst), tokens + max(0.0, now - at) * self.rate), at

    def __len__(self) -> int:
        return len(self._buckets)

    def _prune(self, now: float) -> None:
        """Drop the refilled buckets; if more than half of ``max_users`` remain, the least
        recently used of them (a pass per ``max_users / 2`` new users at most)."""
        kept = [
            (user, (tokens, at))
            for user, (tokens, at) in self._buckets.items()
            if tokens + (now - at) * self.rate < self.burst
        ]
        self._buckets = dict(kept[-max(1, self.max_users // 2) :])
