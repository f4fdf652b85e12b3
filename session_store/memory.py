"""MemoryStore: the durable long-term memory shared by all workers (one Redis hash)."""

from __future__ import annotations

from redis.asyncio import Redis

from bus_redis.codec import text
from bus_redis.keys import Keys


class MemoryStore:
    """``write_memory`` / ``read_memory``; readers cache the text by version."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._cached: tuple[int, str] = (-1, "")

    async def write_memory(self, content: str) -> int:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self.keys.memory, "content", content)
            pipe.hincrby(self.keys.memory, "version", 1)
            _, version = await pipe.execute()
        self._cached = (int(version), content)
        return int(version)

    async def read_memory(self) -> str:
        content, version = await self.redis.hmget(self.keys.memory, ["content", "version"])  # type: ignore[misc]
        self._cached = (int(text(version) or 0), text(content))
        return self._cached[1]

    async def read_cached(self, version: int) -> str:
        """The memory text at ``version`` (known from the lease script): no round trip
        unless it changed since the last read."""
        if version == 0:
            return ""
        if self._cached[0] != version:
            return await self.read_memory()
        return self._cached[1]
