"""Fixtures. ``redis`` runs each test body on fakeredis and on a real redis-server that
the test session starts on a free port. In CI a missing redis-server fails the run."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import fakeredis

# imported up front, not late (pytest then rewrites them at a deep stack): a late import
# can hit CPython 3.11.7's "AST constructor recursion depth mismatch" (hypothesis' plugin
# at the terminal summary; its optimiser, which a test's first run of @given imports)
import hypothesis
import pytest

with contextlib.suppress(ImportError):  # (a module of hypothesis' own: it may move)
    import hypothesis.internal.conjecture.optimiser  # noqa: F401
import redis.asyncio as aioredis

sys.path.insert(0, str(Path(__file__).parent))

from replies import TEST_CHANNELS
from servers import RedisServer, redis_server_binary, require_redis_server

RedisFactory = Callable[[], aioredis.Redis]
_REAL_FIXTURES = {"real_redis", "redis_server", "spawn_workers"}


def pytest_report_header() -> str:
    """Which server the real-Redis side runs on (``REDIS_SERVER`` picks another)."""
    binary = redis_server_binary()
    if binary is None:
        return "real server: none found"
    try:
        version = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        version = f"({type(exc).__name__})"
    return f"real server: {binary}: {version}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that needs the real server carries the ``real_redis`` marker: those
    that ask for it directly, and the ``[real]`` run of the tests on both backends. So
    ``-m "not real_redis"`` runs the fakeredis side only (see docs/TESTING.md)."""
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        callspec = getattr(item, "callspec", None)
        real_param = callspec is not None and callspec.params.get("redis_factory") == "real"
        if (names & _REAL_FIXTURES or real_param) and not item.get_closest_marker("real_redis"):
            item.add_marker(pytest.mark.real_redis)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    require_redis_server()  # in CI a missing redis-server fails, never skips
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
    # as an operator would (agent-worker acl frontend / channels add): the test channels
    await make().sadd("agent:channels", *TEST_CHANNELS)
    yield make
    for client in clients:
        await client.aclose()


@pytest.fixture
async def redis(redis_factory: RedisFactory) -> aioredis.Redis:
    return redis_factory()


@pytest.fixture
async def real_redis(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.from_url(redis_server.url, decode_responses=True)
    await client.flushall()
    await client.sadd("agent:channels", *TEST_CHANNELS)
    yield client
    await client.aclose()


@pytest.fixture
def fake_llm() -> Iterator[object]:
    from fake_llm import FakeLLM

    llm = FakeLLM().start()
    yield llm
    llm.stop()


@pytest.fixture
def spawn_workers(
    redis_server: RedisServer, fake_llm: object
) -> Iterator[Callable[..., list[object]]]:
    """Start ``n`` real worker processes against the session's redis-server and fake LLM."""
    from workers import WorkerProcess

    started: list[WorkerProcess] = []

    def spawn(
        n: int = 1, *, env: dict[str, str] | None = None, url: str | None = None
    ) -> list[object]:
        base = {
            "AGENT_PROVIDER": "openai",
            "AGENT_MODEL": "fake-model",
            "OPENAI_BASE_URL": fake_llm.base_url,
            "OPENAI_API_KEY": "test",  # type: ignore[attr-defined]
            "AGENT_CHANNELS": ",".join(TEST_CHANNELS),
        }
        procs = [
            WorkerProcess(
                url or redis_server.url,
                worker_id=f"w{len(started) + i}",
                env={**base, **(env or {})},
            )
            for i in range(n)
        ]
        started.extend(procs)
        return list(procs)

    yield spawn
    for proc in started:
        print(
            f"----- log of worker {proc.worker_id} -----\n{proc.log()[-4000:]}"
        )  # shown on failure
        proc.close()


@pytest.fixture
async def make_loop(redis_factory: RedisFactory) -> AsyncIterator[Callable[..., object]]:
    """Starts in-process AgentLoops on the test's server (``sessions=`` for a custom
    SessionManager, the rest is LoopConfig); stops them afterwards."""
    import asyncio

    from bus_redis import RedisBus
    from worker import AgentLoop, LoopConfig

    started: list[tuple[AgentLoop, asyncio.Task[None]]] = []

    def make(provider: object, **config: object) -> AgentLoop:
        kw = {"read_block_ms": 50, **config}
        sessions = kw.pop("sessions", None)
        bus = RedisBus(redis_factory())
        loop = AgentLoop(bus, provider, sessions=sessions, config=LoopConfig(**kw))  # type: ignore[arg-type]
        started.append((loop, asyncio.create_task(loop.run())))
        return loop

    yield make
    for loop, task in started:
        loop.stop()
        await asyncio.wait_for(task, 10)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Debian's chromium under Playwright, one per test module (tests/browser.py)."""
    from browser import ARTIFACTS, CHROMIUM
    from servers import in_ci

    if not Path(CHROMIUM).exists():
        if in_ci():
            pytest.fail(
                "chromium is missing in CI: scripts/test.sh installs it (apt-get install chromium)"
            )
        pytest.skip("chromium not installed (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        chromium = pw.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
            ],
        )
        yield chromium
        chromium.close()
