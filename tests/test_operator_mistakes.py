"""A careless operator's mistakes, as a hostile reviewer made them: workers of different
liveness settings, a liveness no worker can keep, Redis restarted without persistence, acl
--user naming the admin or another role, the admin's password replaced, a busy session's
delete, a variable whose name differs from a setting's in case only."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from helpers import ScriptedProvider, run_cli
from redis.exceptions import ConnectionError as RedisConnectionError
from replies import until
from servers import RedisServer, require_redis_server

from bus_redis import FrontendClient, InboundMessage, Keys, RedisBus
from bus_redis.registry import Registry
from worker import AgentLoop, LoopConfig
from worker.agent.providers import LLMResponse

K = Keys()


# --- 1. workers with different AGENT_LIVENESS_MS ------------------------------------------
@pytest.mark.real_redis
async def test_a_live_worker_with_a_longer_liveness_keeps_its_lease(real_redis) -> None:  # type: ignore[no-untyped-def]
    """A rolling change of AGENT_LIVENESS_MS (or one host tuned differently) leaves workers
    with different settings on one Redis. Nothing refuses that (unlike AGENT_UNIFIED_SESSION),
    and each worker judges the others with its *own* limit: a worker at 8000 ms beats every
    second, so one at 800 ms takes it for dead between two beats, deletes its lease while its
    turn runs and has the turn done a second time (a second model call, tools again)."""
    url = real_redis.connection_pool.connection_kwargs
    make = lambda: aioredis.Redis(**url)  # noqa: E731
    started = asyncio.Event()
    release = asyncio.Event()
    calls: list[str] = []

    async def slow(**kw: object) -> LLMResponse:
        calls.append("slow")
        started.set()
        await release.wait()
        return LLMResponse(content="slow")

    async def fast(**kw: object) -> LLMResponse:
        calls.append("fast")
        return LLMResponse(content="fast")

    loops: list[tuple[AgentLoop, asyncio.Task[None]]] = []

    def start(worker_id: str, provider: object, liveness_ms: int) -> AgentLoop:
        cfg = LoopConfig(worker_id=worker_id, liveness_ms=liveness_ms, read_block_ms=50)
        loop = AgentLoop(RedisBus(make()), provider, config=cfg)  # type: ignore[arg-type]
        loops.append((loop, asyncio.create_task(loop.run())))
        return loop

    try:
        start("slow-beat", ScriptedProvider(handler=slow), 8000)
        client = FrontendClient(real_redis)
        await client.send(InboundMessage(channel="web", sender_id="u", chat_id="1", content="hi"))
        await asyncio.wait_for(started.wait(), 10)
        lease = await real_redis.get(K.lease("web:1"))
        assert lease is not None
        assert lease.endswith("|slow-beat")
        start("fast-beat", ScriptedProvider(handler=fast), 800)
        fast_task = loops[-1][1]
        await until(lambda: fast_task.done() or _beats(real_redis, "fast-beat"))
        if fast_task.done():  # refused to start beside a worker of another liveness: fine
            from worker.runtime.registration import WorkerConflictError

            assert isinstance(fast_task.exception(), WorkerConflictError)
            loops.pop()
            return
        # the slow worker, alive all along, beats three more times (once a second)
        for _ in range(3):
            seen = await real_redis.zscore(K.alive, "slow-beat")
            await until(lambda s=seen: _beat_after(real_redis, "slow-beat", s), timeout_s=5)
        assert await real_redis.get(K.lease("web:1")) == lease, "live worker's lease taken over"
        assert calls == ["slow"]
    finally:
        release.set()
        for loop, task in loops:
            loop.stop()
            await asyncio.wait_for(task, 10)


async def _beats(redis: aioredis.Redis, worker_id: str) -> bool:
    return await redis.zscore(K.alive, worker_id) is not None


async def _beat_after(redis: aioredis.Redis, worker_id: str, before: float | None) -> bool:
    now = await redis.zscore(K.alive, worker_id)
    return now is not None and now != before


def test_a_liveness_limit_no_worker_can_keep_is_refused() -> None:
    """AGENT_LIVENESS_MS=1 (a unit slip: seconds meant, or 1 for 'on') is accepted: every
    worker then beats and watches 8,000 times a second, and any pause of a millisecond
    (a GC pass, a network hiccup) makes a live worker 'dead', its turns redone by others.
    The lease has a floor (AGENT_LOCK_TTL_MS >= 300); the liveness limit has none."""
    from pydantic import ValidationError

    from worker.settings import Settings

    for value in (1, 10):
        with pytest.raises(ValidationError):
            Settings(liveness_ms=value)


# --- 2. Redis restarted without persistence ---------------------------------------------
async def test_the_mode_guard_survives_a_redis_restart_without_persistence() -> None:
    """README: a worker refuses to start 'when the workers on that Redis run with another
    AGENT_UNIFIED_SESSION'. The guard is P:mode, written once by the first worker. A Redis
    restarted without persistence (only warned about) forgets it; the running unified
    workers write their heartbeats again (so the worker-id guard comes back) but never
    the mode, and a per-session worker started next is accepted: one chat's history is then
    split between unified:default and its own session."""
    require_redis_server()
    from worker.agent.providers import EchoProvider
    from worker.runtime.registration import WorkerConflictError, check_can_serve

    server = RedisServer(aof=False).start()
    url = server.url
    running = AgentLoop(
        RedisBus(aioredis.from_url(url, decode_responses=True)),
        EchoProvider(),
        config=LoopConfig(worker_id="unified-1", unified_session=True, read_block_ms=50),
    )
    task = asyncio.create_task(running.run())
    probe = aioredis.from_url(url, decode_responses=True)
    try:
        await until(lambda: running._consumer is not None)  # started: serving
        assert await probe.get(K.mode) == "unified"
        server.stop(kill=True)
        server.start()  # same port, nothing kept
        await until(lambda: _registered(probe, "unified-1"), timeout_s=20)  # serving again
        assert not task.done()
        newcomer = RedisBus(aioredis.from_url(url, decode_responses=True))
        try:
            with pytest.raises(WorkerConflictError):
                await check_can_serve(newcomer, "per-session-1", unified=False)
        finally:
            await newcomer.aclose()
    finally:
        running.stop()
        await asyncio.wait_for(task, 10)
        await probe.aclose()
        server.cleanup()


async def _registered(redis: aioredis.Redis, worker_id: str) -> bool:
    try:
        return await redis.zscore(K.workers, worker_id) is not None
    except (OSError, RedisConnectionError):
        return False


# --- 3. acl --user naming the admin or another role ---------------------------------------
def test_acl_refuses_to_reset_the_admin_or_the_workers_user() -> None:
    """`--user` is free text. `acl worker --user default` (the operator meant 'the user my
    URL logs in as') prints, and with --apply runs, `ACL SETUSER default reset ... -@dangerous`:
    the admin loses ACL, CONFIG and the rest of @dangerous, so nobody can repair it; `acl
    frontend --user agent-worker` resets every worker to a frontend's grants (all NOPERM).
    Both print the line and exit 0."""
    refused = [
        ("worker", "--user", "default"),
        ("frontend", "--channel", "web", "--user", "default"),
        ("gateway", "--channel", "web", "--user", "agent-worker"),
    ]
    for args in refused:
        r = run_cli("acl", *args, "--password", "s3cret-pw")
        assert r.returncode == 2, (args, r.returncode, r.stdout)


def test_acl_worker_user_default_applied_keeps_an_admin() -> None:
    """The same on a real redis-server with --apply: the line runs, the admin (the default
    user the compose file and the docs use for every ACL step) can no longer run ACL, and
    only the ACL SAVE that follows fails (exit 1, 'Redis error: NOPERM ...')."""
    require_redis_server()
    import redis as sync_redis
    from redis.exceptions import NoPermissionError

    server = RedisServer().start()
    try:
        r = run_cli(
            "acl", "worker", "--password", "s3cret-pw", "--user", "default", "--apply",
            "--redis-url", server.url,
        )  # fmt: skip
        assert r.returncode == 2, r.stderr  # refused before anything ran
        admin = sync_redis.Redis(port=server.port, decode_responses=True)
        try:
            admin.execute_command("ACL", "LIST")
            still_admin = True
        except NoPermissionError:
            still_admin = False
        finally:
            admin.close()
        assert still_admin, f"the admin was demoted (exit {r.returncode}: {r.stderr.strip()})"
    finally:
        server.cleanup()


# --- 4. sessions delete of a busy session -------------------------------------------------
@pytest.mark.real_redis
def test_sessions_delete_of_a_busy_session_does_not_say_redis_is_unreachable(
    redis_server, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """`sessions delete` waits for the session's lease (30 s) and then raises TimeoutError,
    which is an OSError: main() reports it as 'cannot reach Redis at ...' although Redis
    answered every command. An operator told Redis is down goes looking for the wrong
    problem (and a script retrying on 'unreachable' retries a busy session for ever)."""
    import redis as sync_redis

    from session_store.redis_store import RedisSessionStore

    monkeypatch.setattr(RedisSessionStore.delete, "__kwdefaults__", {"timeout_s": 0.3})
    r0 = sync_redis.Redis(port=redis_server.port, decode_responses=True)
    try:
        r0.flushall()
        r0.hset(K.session("web:busy"), mapping={"meta": "{}", "count": 0})
        r0.set(K.lease("web:busy"), "n1|some-worker", px=60_000)  # a turn runs
        r = run_cli("sessions", "delete", "web:busy", "--redis-url", redis_server.url)
    finally:
        r0.close()
    assert r.returncode != 0
    assert "cannot reach Redis" not in r.stderr, r.stderr


# --- 5. a warning that says a setting is ignored while it is applied ----------------------
def test_a_variable_named_not_a_setting_is_really_ignored(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Settings are read case-insensitively (pydantic-settings' default), the unknown-name
    check case-sensitively: AGENT_Concurrency=2 is warned 'is not a setting (ignored)' and
    yet runs the worker at concurrency 2; and agent_concurency (a typo in lower case) is
    not warned about at all."""
    from worker.cli.main import unknown_variables
    from worker.settings import Settings

    monkeypatch.setenv("AGENT_Concurrency", "2")
    warned = unknown_variables({"AGENT_Concurrency": "2"})
    applied = Settings().concurrency == 2
    assert not (warned and applied), "warned as ignored, but applied"
    assert unknown_variables({"agent_concurency": "2"}) == ["agent_concurency"]


# --- 6. acl default: a new admin password leaves the old one working -----------------------
def test_acl_default_replaces_the_admin_password() -> None:
    """`acl default --password NEW --apply` is how an operator sets (or, after a leak,
    changes) the admin's password. It runs `ACL SETUSER default on >NEW`: `>` *adds* a
    password, so the old, leaked one keeps logging in as the admin (the worker and
    frontend lines start with `reset` and have no such problem)."""
    require_redis_server()
    import redis as sync_redis
    from redis.exceptions import AuthenticationError

    server = RedisServer().start()
    try:
        first = run_cli("acl", "default", "--password", "old-leaked-pw", "--apply",
                        "--redis-url", server.url)  # fmt: skip
        assert first.returncode == 0, first.stderr
        as_admin = f"redis://default:old-leaked-pw@127.0.0.1:{server.port}/0"
        second = run_cli("acl", "default", "--password", "new-secret-pw", "--apply",
                         "--redis-url", as_admin)  # fmt: skip
        assert second.returncode == 0, second.stderr
        old = sync_redis.Redis(port=server.port, password="old-leaked-pw")
        try:
            old.ping()
            old_still_works = True
        except AuthenticationError:
            old_still_works = False
        finally:
            old.close()
        assert not old_still_works, "the replaced admin password still logs in"
    finally:
        server.cleanup()


# --- minor: an age that is no number, a channel that is not there ---------------------------
@pytest.mark.real_redis
def test_an_age_or_a_channel_that_names_nothing_is_one_line(redis_server) -> None:  # type: ignore[no-untyped-def]
    """``sessions prune --older-than inf`` (or nan) used to end in a traceback; ``dlq`` and
    ``cron`` with a mistyped ``--channel`` listed or purged nothing and exited 0."""
    url = redis_server.url
    for age in ("inf", "nan", "-5m"):
        r = run_cli("sessions", "prune", "--older-than", age, "--redis-url", url)
        assert r.returncode == 2, (age, r.returncode, r.stderr)
        assert "Traceback" not in r.stderr
    run_cli("channels", "add", "web", "--redis-url", url)
    for argv in (("dlq", "purge"), ("dlq", "list"), ("cron", "list")):
        r = run_cli(*argv, "--channel", "wbe", "--redis-url", url)
        assert r.returncode == 2, (argv, r.returncode, r.stdout)
        assert "no channel 'wbe'" in r.stderr, r.stderr
    assert run_cli("dlq", "list", "--channel", "web", "--redis-url", url).returncode == 0
    assert run_cli("cron", "list", "--channel", "web", "--redis-url", url).returncode == 0


@pytest.mark.real_redis
def test_a_removed_channel_stays_removed_while_its_ready_queue_exists(redis_server) -> None:  # type: ignore[no-untyped-def]
    """``channels remove C`` used to print "removed" while the next discovery step (any
    worker's, every sweep period) found C's ready queue and registered it again."""
    url = redis_server.url

    async def served(*, send: bool = False) -> tuple[bool, bool, bool]:
        """Whether "old" is found by a whole scan, a worker's bounded step, registered."""
        redis = aioredis.Redis.from_url(url, decode_responses=True)
        try:
            if send:
                msg = InboundMessage(channel="old", sender_id="u", chat_id="1", content="hi")
                await FrontendClient(redis).send(msg)
            registry = Registry(RedisBus(redis))
            whole = "old" in await registry.discover_channels(steps=None)
            step = "old" in await registry.discover_channels()
            return whole, step, "old" in await registry.registered_channels()
        finally:
            await redis.aclose()

    assert asyncio.run(served(send=True)) == (True, True, True)
    assert run_cli("channels", "remove", "old", "--redis-url", url).returncode == 0
    assert asyncio.run(served()) == (False, False, False)
    assert "old" not in run_cli("channels", "list", "--redis-url", url).stdout.split()
    assert run_cli("channels", "add", "old", "--redis-url", url).returncode == 0
    assert asyncio.run(served()) == (True, True, True)


@pytest.mark.real_redis
def test_removing_a_channel_that_does_not_exist_says_so(redis_server) -> None:  # type: ignore[no-untyped-def]
    """``channels remove wbe`` (a typo) used to print "removed" and exit 0, and left the
    typo in ``P:channels:removed``."""
    url = redis_server.url
    r = run_cli("channels", "remove", "wbe", "--redis-url", url)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert "no channel 'wbe'" in r.stderr, r.stderr
    assert "nothing removed" in r.stderr, r.stderr
    assert "removed:" not in r.stdout

    async def removed() -> set[str]:
        redis = aioredis.Redis.from_url(url, decode_responses=True)
        try:
            return set(await redis.smembers(Keys().removed_channels))
        finally:
            await redis.aclose()

    assert "wbe" not in asyncio.run(removed())
    assert run_cli("channels", "add", "wbe", "--redis-url", url).returncode == 0
    r = run_cli("channels", "remove", "wbe", "--redis-url", url)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "channel wbe removed" in r.stdout, r.stdout
    assert "wbe" in asyncio.run(removed())
