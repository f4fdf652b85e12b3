"""Liveness (worker/runtime/liveness.py): a killed holder's sessions are taken over long before its
lease would run out, with a new nonce; a live worker whose event loop stalls keeps them.
The scripts themselves on fakeredis and a real redis-server; the processes on real ones."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis
from replies import collect, until, wait_until_async

from bus_redis import FrontendClient, InboundMessage, Keys, RedisBus
from bus_redis.registry import Registry

K = Keys()


def _m(chat: str, text: str) -> InboundMessage:
    return InboundMessage(
        id=f"{chat}:{text}", channel="web", sender_id="u", chat_id=chat, content=text
    )


async def test_takeover_deletes_only_the_dead_holders_leases_and_renotifies(
    redis: aioredis.Redis,
) -> None:
    bus = RedisBus(redis, lock_ttl_ms=10_000)
    sweeps = Registry(bus).sweeps
    await bus.ensure_groups([K.ready("web")])
    for key, worker in (("web:a", "dead"), ("web:b", "alive"), ("web:c", "dead")):
        await redis.set(K.lease(key), f"n-{key}|{worker}", px=10_000)
        await redis.zadd(K.leases("web"), {key: 1})
    await redis.set(K.lease("web:c"), "other-nonce|dead", px=10_000)  # renewed meanwhile? no:
    # takeover compares the value it read; a value changed between read and script stays
    await redis.zadd(K.alive, {"alive": 10_000, "dead": 1_000})
    assert sorted(await sweeps.takeover(["web"], "dead", dead_after_ms=800)) == ["web:a", "web:c"]
    assert await redis.get(K.lease("web:a")) is None
    assert await redis.get(K.lease("web:b")) == "n-web:b|alive"
    assert await redis.zrange(K.leases("web"), 0, -1) == ["web:b"]
    notes = [f for _, f in await redis.xrange(K.ready("web"))]
    assert notes == [{"session": "web:a"}, {"session": "web:c"}]  # each its own stream
    assert await sweeps.takeover(["web"], "dead", dead_after_ms=800) == []  # idempotent


async def test_the_unified_key_is_renotified_as_effective(redis: aioredis.Redis) -> None:
    """Only the unified key drains a pending set: its re-notification says so, by the
    takeover as by the lease sweep."""
    bus = RedisBus(redis, lock_ttl_ms=10_000)
    sweeps = Registry(bus).sweeps
    u = "unified:default"
    await bus.ensure_groups([K.ready("unified")])
    await redis.set(K.lease(u), "n|dead", px=10_000)
    await redis.zadd(K.leases("unified"), {u: 1})
    await redis.zadd(K.alive, {"alive": 10_000, "dead": 1_000})
    assert await sweeps.takeover(["unified"], "dead", dead_after_ms=800) == [u]
    await redis.zadd(K.leases("unified"), {u: 1})  # and again, as if its lease ran out
    assert await sweeps.leases(["unified"]) == [u]
    notes = [f for _, f in await redis.xrange(K.ready("unified"))]
    assert notes == [{"session": u, "effective": "1"}] * 2


async def test_dead_workers_are_those_whose_beat_is_older_than_the_limit(
    redis: aioredis.Redis,
) -> None:
    sweeps = Registry(RedisBus(redis)).sweeps
    now = await sweeps.beat("fresh")
    await redis.zadd(K.alive, {"stale": now - 5_000})
    assert await sweeps.dead_workers(1_000, forget_after_ms=60_000) == ["stale"]
    await sweeps.forget_dead("stale")
    assert await sweeps.dead_workers(1_000, forget_after_ms=60_000) == []


async def test_silence_is_judged_against_the_freshest_beat(redis: aioredis.Redis) -> None:
    """After Redis itself stalled, every beat is old by the clock: nobody is dead until
    one worker beats again and another does not."""
    sweeps = Registry(RedisBus(redis)).sweeps
    await redis.zadd(K.alive, {"a": 1_000_000, "b": 1_000_100})  # both long ago
    assert await sweeps.dead_workers(800, forget_after_ms=60_000) == []
    await redis.zadd(K.alive, {"b": 1_002_000})
    assert await sweeps.dead_workers(800, forget_after_ms=60_000) == ["a"]


async def test_the_most_recently_dead_come_first_and_the_long_dead_are_forgotten(
    redis: aioredis.Redis,
) -> None:
    sweeps = Registry(RedisBus(redis)).sweeps
    now = await sweeps.beat("me")
    await redis.zadd(K.alive, {f"old{i}": now - 30_000 - i for i in range(20)})
    await redis.zadd(K.alive, {"ancient": now - 120_000, "just": now - 2_000})
    dead = await sweeps.dead_workers(800, forget_after_ms=60_000, limit=16)
    assert dead[0] == "just"
    assert len(dead) == 16
    assert await redis.zscore(K.alive, "ancient") is None  # forgotten


async def test_a_holder_that_beats_again_keeps_its_lease(redis: aioredis.Redis) -> None:
    """Between a survivor's look and its takeover the holder beat (it restarted under its
    id and took the session again): the script judges silence again and keeps the lease."""
    bus = RedisBus(redis)
    sweeps = Registry(bus).sweeps
    await bus.ensure_groups([K.ready("web")])
    await redis.set(K.lease("web:x"), "fresh|X", px=10_000)
    await redis.zadd(K.leases("web"), {"web:x": 1})
    await sweeps.beat("S")
    await sweeps.beat("X")
    assert await sweeps.takeover(["web"], "X", dead_after_ms=800) == []
    assert await redis.get(K.lease("web:x")) == "fresh|X"
    assert not await sweeps.still_dead("X", 800)
    # the worker itself, starting, hands over what its former life held
    assert await sweeps.takeover(["web"], "X", dead_after_ms=None) == ["web:x"]


def _holder(value: str | None) -> str:
    return (value or "|").split("|", 1)[1]


@pytest.mark.real_redis
@pytest.mark.slow
async def test_a_killed_holder_is_replaced_before_its_lease_runs_out(
    real_redis, spawn_workers, fake_llm
) -> None:  # type: ignore[no-untyped-def]
    """Default lease TTL (10 s): the survivor takes the session over with a new nonce while
    the dead holder's lease is still valid, and answers it once, from the takeover's own
    notification (the stranded-stream sweep, which would find the message too, does not
    run again during the test)."""
    workers = {w.worker_id: w for w in spawn_workers(2, env={"AGENT_SWEEP_INTERVAL_MS": "600000"})}
    client = FrontendClient(real_redis)
    mid = await client.send(_m("f", "block takeover"))
    assert await asyncio.to_thread(fake_llm.started.wait, 20)
    lease = K.lease("web:f")
    before = await real_redis.get(lease)
    dead = workers[_holder(before)]
    dead.kill()
    runs_out = time.monotonic() + (await real_redis.pttl(lease)) / 1000
    fake_llm.release()

    async def taken_over() -> bool:  # deleted (then maybe taken, answered and released)
        return await real_redis.get(lease) != before

    assert await wait_until_async(taken_over, timeout_s=20)
    assert time.monotonic() < runs_out  # by liveness, not because the lease ran out
    assert _holder(await real_redis.get(lease)) != dead.worker_id
    got = await collect(client, "web", {mid}, timeout_s=20)
    assert [ev.type for ev in got[mid] if ev.is_terminal] == ["message"]
    assert got[mid][-1].metadata["worker"] != dead.worker_id
    assert time.monotonic() < runs_out  # answered too before the dead lease would run out


@pytest.mark.real_redis
@pytest.mark.slow
async def test_a_worker_whose_loop_stalls_keeps_its_lease(
    real_redis, spawn_workers, fake_llm
) -> None:  # type: ignore[no-untyped-def]
    """A live but slow worker: its event loop blocks for 2 s (2.5 liveness limits) just
    before its first model call; its beat goes on from its own thread, so the other worker
    takes nothing over, and the one holder answers."""
    env = {"AGENT_FAULT_POINTS": "stall:before_model", "AGENT_FAULT_STALL_S": "2"}
    workers = spawn_workers(2, env=env)  # whichever serves the session stalls
    for w in workers:
        assert await wait_until_async(lambda w=w: _beats(real_redis, w.worker_id), timeout_s=20)
    client = FrontendClient(real_redis)
    seen: set[str] = set()
    watch = asyncio.create_task(_holders(real_redis, K.lease("web:s"), seen))
    mid = await client.send(_m("s", "hi"))
    got = await collect(client, "web", {mid}, timeout_s=20)
    watch.cancel()
    assert [ev.type for ev in got[mid] if ev.is_terminal] == ["message"]
    assert len(seen) == 1  # one holder, one nonce, from acquire to release
    assert all("stopped beating" not in w.log() for w in workers)
    assert len(fake_llm.requests) == 1


async def _beats(redis: aioredis.Redis, worker_id: str) -> bool:
    return await redis.zscore(K.alive, worker_id) is not None


async def _holders(redis: aioredis.Redis, lease: str, seen: set[str]) -> None:
    while True:
        value = await redis.get(lease)
        if value is not None:
            seen.add(value)
        await asyncio.sleep(0.01)


async def test_a_worker_whose_own_beat_fails_takes_over_no_one(
    redis: aioredis.Redis, make_loop
) -> None:  # type: ignore[no-untyped-def]
    """Redis out of memory (or read-only) refuses every beat, so every worker looks dead
    to every other: a worker whose own beat does not land judges no one, instead of
    taking over the leases of live workers and having all their turns done again."""
    from redis.exceptions import OutOfMemoryError

    from worker.agent.providers import EchoProvider

    loop = make_loop(EchoProvider(), liveness_ms=800)
    await until(lambda: loop.liveness.beat_ok_at > float("-inf"))  # running, beating
    sweeps = loop.rt.registry.sweeps
    beat, refusals = sweeps.beat, []

    async def refused(worker_id: str) -> int:
        refusals.append(worker_id)
        raise OutOfMemoryError("command not allowed when used memory > 'maxmemory'.")

    sweeps.beat = refused  # type: ignore[method-assign]
    await until(lambda: len(refusals) >= 1)  # a beat begun before has landed by now
    loop.liveness.beat_ok_at = float("-inf")
    await redis.set(K.lease("web:held"), "n1|other", px=60_000)
    await redis.zadd(K.leases("web"), {"web:held": 1})
    secs, micros = await redis.time()
    await redis.zadd(K.alive, {"other": secs * 1000 + micros // 1000 - 5_000})  # stopped 5 s ago
    assert await loop.liveness.watch_once() == []
    seen = len(refusals)
    await until(lambda: len(refusals) >= seen + 3)  # the watch ran meanwhile too
    assert await redis.get(K.lease("web:held")) == "n1|other"  # not taken
    sweeps.beat = beat  # type: ignore[method-assign]
    # its own beat lands again: the dead holder's lease is taken over
    await until(lambda: _gone(redis, K.lease("web:held")))


async def test_after_redis_became_another_server_no_one_is_judged_until_beats_landed_there(
    redis: aioredis.Redis, make_loop
) -> None:  # type: ignore[no-untyped-def]
    """Redis restarted from an older snapshot between two of this worker's beats (or a
    failover to a lagging replica that the client reached by retrying): none of its
    beats failed, yet every other worker's beat on the new server is old. Judged at once,
    every live worker's leases would be taken over and their turns done again. A
    connection that finds another server restarts the streak: others are judged only
    once this worker's beats have landed there for a liveness period."""
    from bus_redis.server_watch import ServerWatch
    from worker.agent.providers import EchoProvider

    loop = make_loop(EchoProvider(), liveness_ms=800)
    await until(lambda: loop.liveness.beat_ok_at > float("-inf"))  # running, beating
    loop.liveness.beat_ok_since -= 3600  # its beats have landed for long
    secs, micros = await redis.time()
    now_ms = secs * 1000 + micros // 1000
    await redis.set(K.lease("web:held"), "n1|other", px=60_000)
    await redis.zadd(K.leases("web"), {"web:held": now_ms + 60_000})  # (its expiry)
    await redis.zadd(K.alive, {"other": now_ms - 5_000})  # (the old server's copy)
    watch = ServerWatch.of(loop.bus.redis.connection_pool)
    watch.server = "the-server-before"
    watch.seen("the-server-now")  # a connection reached another server
    assert await loop.liveness.watch_once() == []
    assert await redis.get(K.lease("web:held")) == "n1|other"  # not taken
    # once its beats landed for a liveness period, the silent one is taken over
    await until(lambda: _gone(redis, K.lease("web:held")))


async def _gone(redis: aioredis.Redis, key: str) -> bool:
    return await redis.get(key) is None


async def test_a_worker_id_restarted_without_beats_leaves_no_old_beat(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """A fixed ``AGENT_WORKER_ID`` restarted with ``AGENT_LIVENESS_MS=0`` never beats: its
    former life's beat, left in ``P:alive``, looked like a worker gone silent, and workers
    that beat took over the leases this life holds (its turns done twice)."""
    from worker.agent.providers import EchoProvider

    secs, micros = await redis.time()
    await redis.zadd(K.alive, {"fixed": secs * 1000 + micros // 1000 - 5_000})  # a former life
    loop = make_loop(EchoProvider(), worker_id="fixed", liveness_ms=0)
    reply = await FrontendClient(redis).ask(_m("q", "hello"), timeout_s=10)
    assert reply.content
    assert loop.worker_id == "fixed"
    assert await redis.zscore(K.alive, "fixed") is None


async def test_a_starting_worker_does_not_warn_its_beat_is_failing(
    redis: aioredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker's watch that runs before its first beat has landed (at start) skipped
    quietly only after warning "own liveness beat is failing": every start, the demo's
    included, printed it for each worker. It warns once a beat had landed and then the
    beats stopped landing."""
    from worker import AgentLoop, LoopConfig
    from worker.agent.providers import EchoProvider

    loop = AgentLoop(RedisBus(redis), EchoProvider(), config=LoopConfig(liveness_ms=800))
    try:
        with caplog.at_level("WARNING", logger="worker.runtime.liveness"):
            assert await loop.liveness.watch_once() == []
            assert "beat is failing" not in caplog.text
            loop.liveness.beat_ok_at = time.monotonic() - 5  # landed, then stopped landing
            assert await loop.liveness.watch_once() == []
            assert await loop.liveness.watch_once() == []
        assert caplog.text.count("own liveness beat is failing") == 1
    finally:
        await loop.jobs.aclose()
