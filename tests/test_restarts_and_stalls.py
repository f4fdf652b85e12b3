"""Crashes, stalls and restarts as a hostile reviewer attacked them, with real
``agent-worker run`` processes and a real redis-server: a Redis back from an older
snapshot, a subagent whose worker was killed, a stalled holder waking after its lease was
taken. Each test failed on the code before its fix."""

from __future__ import annotations

import asyncio
import json
import signal
from typing import Any

import pytest
import redis.asyncio as aioredis
from proxies import RedisProxy
from replies import channel_events, collect, until
from servers import RedisServer

from bus_redis import FrontendClient, InboundMessage, Keys

pytestmark = [pytest.mark.real_redis, pytest.mark.slow]
K = Keys()
FAST = {"AGENT_LOCK_TTL_MS": "1000", "AGENT_OWNER_TTL_MS": "1000", "AGENT_FOLLOWUP_MODE": "queue"}


def _m(chat: str, text: str) -> InboundMessage:
    return InboundMessage(
        id=f"{chat}:{text}", channel="web", sender_id="u", chat_id=chat, content=text
    )


async def _beats(redis: aioredis.Redis, worker_id: str) -> bool:
    return await redis.zscore(K.alive, worker_id) is not None


async def _users(redis: aioredis.Redis, key: str) -> list[str]:
    h = await redis.hgetall(K.session(key))
    rows = [json.loads(h[f"m:{i}"]) for i in range(int(h.get("count", 0)))]
    return [r["content"] for r in rows if r["role"] == "user"]


@pytest.mark.parametrize(
    ("query", "ttl_ms"),
    [("", "1000"), ("?socket_timeout=30", "1000"), ("?socket_timeout=30", "60000")],
    ids=["multiplexed", "redis-py connection", "redis-py connection, no tick meanwhile"],
)
async def test_a_cached_session_is_not_taken_as_current_after_redis_came_back_older(
    spawn_workers, fake_llm, query: str, ttl_ms: str
) -> None:  # type: ignore[no-untyped-def]
    """Redis comes back from an RDB snapshot (the same holds for AOF ``everysec`` or a
    failover to a replica that lagged): the session hash is one turn older than the copy
    worker w0 cached. Another worker (w1) then commits a different turn, which brings the
    hash back to the *same* ``version`` number with the same ``gen``. w0's next turn takes
    its cached copy as current (``SessionManager.load_for_turn`` compares only version
    and generation), so the model is shown a message the store does not hold and not the
    one it does, and that worker keeps the diverged copy for every later turn. With
    ``socket_timeout`` in its URL (as TLS, Sentinel, RESP3 or a credential provider) the
    worker has no multiplexed connection: each connection of its pool must tell when it
    connects, before it answers a command. A maintenance tick that looks (every third of
    the lease TTL) came too late when none ran between the restart and the turn: the
    third case (a 60 s TTL) failed on that code, and the second once under load."""
    server = RedisServer(aof=False).start()
    env = FAST | {"AGENT_LOCK_TTL_MS": ttl_ms, "AGENT_OWNER_TTL_MS": ttl_ms}
    try:
        (w0,) = spawn_workers(1, env=env, url=server.url + query)
        redis = aioredis.from_url(server.url, decode_responses=True)
        client = FrontendClient(redis)
        await collect(client, "web", {await client.send(_m("r", "one"))}, timeout_s=20)
        await redis.save()  # the snapshot the restarted server comes back from
        await collect(client, "web", {await client.send(_m("r", "two"))}, timeout_s=20)
        await redis.aclose()
        server.stop(kill=True)  # crash: "two" was never snapshotted
        server.start()
        redis = aioredis.from_url(server.url, decode_responses=True)
        client = FrontendClient(redis)
        assert await _users(redis, "web:r") == ["one"]

        w0.signal(signal.SIGSTOP)  # so that another worker serves the next turn
        (w1,) = spawn_workers(1, env=env, url=server.url + query)
        await collect(client, "web", {await client.send(_m("r", "three"))}, timeout_s=30)
        w1.kill()
        w0.signal(signal.SIGCONT)
        four = await client.send(_m("r", "four"))
        got = await collect(client, "web", {four}, timeout_s=30)

        assert [e.metadata.get("worker") for e in got[four] if e.is_terminal] == ["w0"]
        stored = await _users(redis, "web:r")
        assert stored == ["one", "three", "four"]
        shown = [m["content"] for m in fake_llm.requests[-1]["messages"] if m["role"] == "user"]
        assert shown == stored, "the model saw a history the store does not hold"
        await redis.aclose()
    finally:
        server.cleanup()


async def test_a_subagent_of_a_killed_worker_reports_back_without_arqs_job_timeout(
    real_redis, spawn_workers, fake_llm
) -> None:  # type: ignore[no-untyped-def]
    """A subagent runs (arq job) on a worker that is killed -9. Its registration says
    ``running`` on the dead worker and arq's in-progress key for the job lives
    ``JOB_TIMEOUT_S + 10`` = 910 s: no other worker runs it again before then, so the
    result comes back a quarter of an hour late (leases are taken over in a second)."""
    workers = {w.worker_id: w for w in spawn_workers(2, env=FAST)}
    for w in workers:
        await until(lambda w=w: _beats(real_redis, w), timeout_s=20)
    held: list[str] = []
    fake_llm.on_block = held.append  # the subagent's model call is held ("block" in its task)
    client = FrontendClient(real_redis)
    args = '{"task": "bl\\u006fck sub", "label": "sub"}'  # "block" escaped in the parent's text
    first = await client.send(_m("sa", f"toolcall:spawn{args}"))
    await collect(client, "web", {first}, timeout_s=30)
    await until(lambda: bool(held), timeout_s=30)

    async def running() -> tuple[str, str] | None:
        for sid, raw in (await real_redis.hgetall(K.spawned("web:sa"))).items():
            doc = json.loads(raw)
            if doc.get("state") == "running":
                return sid, doc["worker"]
        return None

    await until(running, timeout_s=20)
    sid, runner = await running()  # type: ignore[misc]
    workers[runner].kill()
    fake_llm.release()

    async def reported() -> bool:
        return any(
            e.reply_to == f"spawn:{sid}" and e.is_terminal
            for e in await channel_events(client, "web")
        )

    loop = asyncio.get_running_loop()
    deadline = loop.time() + 45
    while not await reported() and loop.time() < deadline:
        await asyncio.sleep(0.1)  # poll: the result comes from another process
    in_progress = await real_redis.pttl(f"arq:in-progress:agent:subagent:{sid}")
    assert await reported(), (
        f"no result of subagent {sid} 45 s after its worker died; "
        f"arq's in-progress key still lives {in_progress} ms"
    )


async def test_a_stalled_workers_subagent_run_again_elsewhere_ends_when_it_wakes(
    real_redis, spawn_workers, fake_llm
) -> None:  # type: ignore[no-untyped-def]
    """A subagent's worker stalls (SIGSTOP) mid model call; a survivor judges it dead and
    runs the subagent again. When the stalled worker wakes, its run went on (the
    registration was only looked at for existing): a second model call paid for the same
    task, and whichever run finished first published. Now the registration names its run,
    and the woken worker's run ends at its next look: it hangs up its model call (the
    fake model counts the hang-up) and publishes nothing; the survivor's run publishes."""
    workers = {w.worker_id: w for w in spawn_workers(2, env=FAST)}
    for w in workers:
        await until(lambda w=w: _beats(real_redis, w), timeout_s=20)
    held: list[str] = []
    fake_llm.on_block = held.append  # every model call of the subagent is held
    client = FrontendClient(real_redis)
    args = '{"task": "bl\\u006fck sub", "label": "sub"}'  # "block" escaped in the parent's text
    first = await client.send(_m("ss", f"toolcall:spawn{args}"))
    await collect(client, "web", {first}, timeout_s=30)

    async def running() -> tuple[str, str] | None:
        for sid, raw in (await real_redis.hgetall(K.spawned("web:ss"))).items():
            doc = json.loads(raw)
            if doc.get("state") == "running":
                return sid, doc["worker"]
        return None

    await until(running, timeout_s=20)
    sid, stalled = await running()  # type: ignore[misc]
    await until(lambda: len(held) >= 1, timeout_s=20)
    workers[stalled].signal(signal.SIGSTOP)

    async def rerun() -> bool:
        now = await running()
        return now is not None and now[1] != stalled

    await until(rerun, timeout_s=30)  # a survivor claimed it ...
    await until(lambda: len(held) >= 2, timeout_s=20)  # ... and runs it: its call, held too
    workers[stalled].signal(signal.SIGCONT)
    # the woken run hangs up its held model call (it would wait for its answer, then go on)
    await until(lambda: fake_llm.hangups >= 1, timeout_s=20)
    fake_llm.release()

    async def results() -> list[str]:
        return [
            e.metadata.get("worker") or ""
            for e in await channel_events(client, "web")
            if e.reply_to == f"spawn:{sid}" and e.is_terminal
        ]

    await until(lambda: _nonempty(results), timeout_s=30)
    assert len(await results()) == 1
    assert not await real_redis.exists(K.spawned("web:ss"))  # done: nothing left registered


async def _nonempty(get: Any) -> bool:
    return bool(await get())


async def test_a_consolidation_of_a_killed_worker_runs_again_without_arqs_job_timeout(
    real_redis, spawn_workers, fake_llm
) -> None:  # type: ignore[no-untyped-def]
    """A consolidation job (arq) runs on a worker that is killed -9 mid model call. arq's
    in-progress key keeps the job from every other worker for 15 minutes, and each later
    turn's enqueue is refused as a duplicate: the session's memory stays unwritten that
    long. The survivor that judges the worker dead runs it again at once."""
    env = {**FAST, "AGENT_CONSOLIDATE_ABOVE_TOKENS": "1"}
    workers = {w.worker_id: w for w in spawn_workers(2, env=env)}
    for w in workers:
        await until(lambda w=w: _beats(real_redis, w), timeout_s=20)
    client = FrontendClient(real_redis)
    first = await client.send(_m("cj", "remember: the milk is blue (block)"))
    assert await asyncio.to_thread(fake_llm.started.wait, 20)
    fake_llm.release()  # the turn answered; the fold of its rows is held again below
    await collect(client, "web", {first}, timeout_s=30)
    fake_llm.rearm()
    held: list[str] = []
    fake_llm.on_block = held.append
    for i in range(4):  # 10 rows: the first two are past the 8 kept as they are
        sent = await client.send(_m("cj", f"more {i}"))
        await collect(client, "web", {sent}, timeout_s=30)
    await until(lambda: any(t.startswith("# Current memory") for t in held), timeout_s=30)

    async def runner() -> str | None:
        for w in workers:
            if await real_redis.hlen(K.worker_jobs(w)):
                return w
        return None

    await until(runner, timeout_s=20)
    workers[await runner()].kill()  # type: ignore[index]
    fake_llm.release()
    scope = "web/sender:u"

    async def folded() -> bool:
        return bool(await real_redis.hget(K.memory(scope), "content"))

    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while not await folded() and loop.time() < deadline:
        await asyncio.sleep(0.1)  # poll: the fold is written by another process
    job = "arq:in-progress:agent:consolidate:web:cj"
    assert await folded(), (
        f"no memory 30 s after the consolidating worker died; arq's in-progress key "
        f"still lives {await real_redis.pttl(job)} ms"
    )


async def test_a_stalled_holder_whose_lease_was_taken_calls_no_model(
    real_redis, redis_server, spawn_workers, fake_llm
) -> None:  # type: ignore[no-untyped-def]
    """w0's event loop is blocked (5 s) right before its model call, past its lease
    (1 s). The lease runs out in Redis, w1 takes the session and its model call is held.
    When w0's loop runs again it sends its model call at once: nothing checks the
    lease's local deadline (``Lease._deadline``, long past) before a model call; only the
    overdue renewal, answered after the call went out, tells w0. Two turns of one session
    then run at once (the fake model counts the overlap); their writes are fenced, the
    second model call is not. w0 talks to Redis through a gated proxy, held while it
    wakes, so that its renewal's answer cannot come first (without the gate the two race:
    2 of 3 runs overlapped)."""
    proxy = RedisProxy(redis_server.port)
    url = await proxy.start()
    try:
        stall = {**FAST, "AGENT_FAULT_POINTS": "stall:before_model", "AGENT_FAULT_STALL_S": "5"}
        (w0,) = spawn_workers(1, env=stall, url=url)
        await until(lambda: _beats(real_redis, w0.worker_id), timeout_s=20)
        client = FrontendClient(real_redis)
        mid = await client.send(_m("o", "[o] block overlap"))

        async def held_by(worker: str) -> bool:
            return str(await real_redis.get(K.lease("web:o"))).endswith(f"|{worker}")

        await until(lambda: held_by("w0"), timeout_s=20)
        spawn_workers(1, env=FAST)
        await until(lambda: held_by("w1"), timeout_s=20)  # w0 is still stalled (5 s)
        assert await asyncio.to_thread(fake_llm.started.wait, 20)  # w1's model call, held
        proxy.open.clear()

        def woke() -> bool:  # w0's stall ended: it saw its lease's term over, or it called
            return "ran out while this worker stalled" in w0.log() or fake_llm.overlaps > 0

        await until(woke, timeout_s=30)
        proxy.open.set()

        async def w0_lost_it() -> bool:
            info = await real_redis.hgetall(K.worker_info("w0"))
            return int(info.get("leases_lost", 0)) >= 1

        await until(w0_lost_it, timeout_s=30)
        fake_llm.release()
        got = await collect(client, "web", {mid}, timeout_s=30)

        assert sum(e.is_terminal for e in got[mid]) == 1
        assert await _users(real_redis, "web:o") == ["[o] block overlap"]
        assert fake_llm.overlaps == 0, (
            f"{len(fake_llm.requests)} model calls, {fake_llm.overlaps} while another ran"
        )
    finally:
        await proxy.close()
