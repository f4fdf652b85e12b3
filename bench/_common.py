"""Shared bench helpers: an own redis-server and a round-trip counting client."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from servers import RedisServer

__all__ = ["CountingRedis", "RedisServer", "percentile", "summary"]


class CountingRedis(aioredis.Redis):
    """Counts round trips: every command outside a pipeline and every pipeline execute."""

    round_trips = 0

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        CountingRedis.round_trips += 1
        return await super().execute_command(*args, **options)

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Any:
        pipe = super().pipeline(transaction, shard_hint)
        execute = pipe.execute

        async def counted(raise_on_error: bool = True) -> Any:
            CountingRedis.round_trips += 1
            return await execute(raise_on_error)

        pipe.execute = counted  # type: ignore[method-assign]
        return pipe


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(values: list[float]) -> str:
    return (
        f"p50 {percentile(values, 0.5):.2f} ms  p99 {percentile(values, 0.99):.2f} ms  "
        f"mean {statistics.fmean(values):.2f} ms"
    )
