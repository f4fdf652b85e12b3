"""Fixtures. ``redis`` runs each test body on fakeredis and on a real redis-server that
the test session starts on a free port. In CI a missing redis-server fails the run."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import fakeredis
import pytest
import redis.asyncio as aioredis

sys.path.insert(0, str(Path(__file__).parent))

from servers import RedisServer, in_ci, redis_server_binary  # noqa: E402

RedisFactory = Callable[[], aioredis.Redis]


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    if redis_server_binary() is None:
        if in_ci():
            pytest.fail("redis-server is missing in CI: scripts/test.sh installs it (apt-get install redis-server)")
        pytest.skip("redis-server not installed (run scripts/test.sh to install it)")
    server = RedisServer().start()
    yield server
    server.cleanup()


@pytest.fixture(params=["fake", "real"])
async def redis_factory(request: pytest.FixtureRequest) -> AsyncIterator[RedisFactory]:
    """Makes clients of one server: fakeredis, or the session's real redis-server."""
    clients: list[aioredis.Redis] = []
    if request.param == "fake":
        server = fakeredis.FakeServer()

        def make() -> aioredis.Redis:
            client = fakeredis.FakeAsyncRedis(server=server, decode_responses=True)
            clients.append(client)
            return client
    else:
        real: RedisServer = request.getfixturevalue("redis_server")

        def make() -> aioredis.Redis:
            client = aioredis.from_url(real.url, decode_responses=True)
            clients.append(client)
            return client

        await make().flushall()
    yield make
    for client in clients:
        await client.aclose()


@pytest.fixture
async def redis(redis_factory: RedisFactory) -> aioredis.Redis:
    return redis_factory()
