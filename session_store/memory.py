"""MemoryStore: long-term memory, one Redis hash per scope, shared by all workers."""

from __future__ import annotations

from redis.asyncio import Redis

from bus_redis.codec import text
from bus_redis.keys import Keys
from session_store.models import OWNER_SCOPE
from session_store.shares import Shares

MEMORY_CACHE_SCOPES = 1024  # scopes whose memory text a worker keeps (~4,000 characters each)


class MemoryStore:
    """``write_memory`` / ``read_memory`` of one scope; readers cache the text by version.

    Turns never write memory: consolidation replaces it, compare-and-set on its version, with
    a fenced script
    (``bus_redis/lua/consolidate.lua``). ``write_memory`` replaces it (administration).

    The cache holds ``MEMORY_CACHE_SCOPES`` scopes; past it, the least recently used scope
    of the channel holding the most goes (a scope is ``<channel>/...``): one channel's
    many users never push another channel's memory out.
    """

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._cached: dict[str, tuple[int, str]] = {}
        self._shares = Shares(1)

    def forget_cached(self) -> None:
        """Forget every cached memory (Redis came back as another server)."""
        self._cached.clear()
        self._shares.clear()

    def key(self, scope: str = OWNER_SCOPE) -> str:
        return self.keys.memory(scope)

    async def write_memory(self, content: str, scope: str = OWNER_SCOPE) -> int:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self.key(scope), "content", content)
            pipe.hincrby(self.key(scope), "version", 1)
            _, version = await pipe.execute()
        self._remember(scope, int(version), content)
        return int(version)

    async def read_memory(self, scope: str = OWNER_SCOPE) -> str:
        content, version = await self.redis.hmget(self.key(scope), ["content", "version"])  # type: ignore[misc]
        return self._remember(scope, int(text(version) or 0), text(content))

    async def read_cached(self, version: int, scope: str = OWNER_SCOPE) -> str:
        """The memory text at ``version`` (known from the lease script): no round trip
        unless it changed since the last read."""
        if version == 0:
            return ""
        cached = self._cached.get(scope)
        if cached is None or cached[0] != version:
            return await self.read_memory(scope)
        self._shares.touch(scope)
        return cached[1]

    def version(self, scope: str = OWNER_SCOPE) -> int:
        """The version of the last read of ``scope`` (-1 when never read)."""
        return self._cached.get(scope, (-1, ""))[0]

    def _remember(self, scope: str, version: int, content: str) -> str:
        self._cached[scope] = (version, content)
        self._shares.put(scope.partition("/")[0], scope, (1,))
        self._shares.trim(self._cached, MEMORY_CACHE_SCOPES, scope)
        return content
