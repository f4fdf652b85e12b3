"""Second reading of 1de0351 (ServerWatch on every pool connection) and 93f8f97 (a
subagent's registration names its run; a superseded run ends)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import pytest
import redis.asyncio as aioredis
from helpers import ScriptedProvider
from replies import until
from servers import RedisServer

from bus_redis import ControlMessage, Keys, RedisBus
from worker.agent.providers import LLMResponse

K = Keys()
SESSION = "web:rv"
SID = "s1"


# --- 1de0351: a connection of the worker's pool that bypasses the watch ---------------------


@pytest.mark.real_redis
async def test_the_startup_pings_connection_reaches_a_new_server_without_telling() -> None:
    """``agent-worker run`` pings Redis (``runner._connect``) before it builds the loop, so
    the first connection of the pool is made before ``ServerWatch.watch`` wraps
    ``make_connection``: it never gets the connect callback. It stays in the pool (LIFO,
    so it is used as much as any), and when it is the one that reconnects after a
    restart from an older snapshot, the cached sessions are not dropped (and the
    maintenance tick's look that covered this is gone)."""
    from worker.app import make_loop, make_redis
    from worker.cli.runner import _connect
    from worker.settings import Settings

    server = RedisServer(aof=False).start()
    redis = None
    try:
        url = server.url + "?socket_timeout=30"  # no multiplexed connection: redis-py's pool
        settings = Settings(redis_url=url, provider="echo", jobs="local", worker_id="w0")
        redis = make_redis(url)
        assert await _connect(redis, "here", asyncio.Event())  # as runner.run does
        make_loop(settings, redis)  # as runner.run does, right after
        pool = redis.connection_pool
        watch = pool._server_watch
        told: list[int] = []
        watch.on_new_server = lambda: told.append(1)
        # two commands at once: the startup ping's connection and a new (watched) one
        first = await pool.get_connection()
        second = await pool.get_connection()
        assert watch.server  # the new one told which server this is
        await pool.release(second)
        await pool.release(first)  # the next command takes this one (the pool is LIFO)

        server.stop(kill=True)
        server.start()  # another run_id: a restart (from an older snapshot)

        async def answered() -> bool:
            try:
                await redis.get("anything")
            except (ConnectionError, aioredis.ConnectionError):
                return False
            return True

        await until(answered, timeout_s=10)
        assert told == [1], "a command was answered by the new server, caches kept"
    finally:
        if redis is not None:
            await redis.aclose()
            await redis.connection_pool.disconnect()
        server.cleanup()


# --- 93f8f97: a stale run and the survivor's re-run ---------------------------------------


class Model:
    """Each subagent model call is held until ``release``; counts calls and hang-ups."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.calls = 0
        self.cancelled = 0

    async def __call__(self, **kw: Any) -> LLMResponse:
        last = kw["messages"][-1]
        if last["role"] == "user" and str(last["content"]).startswith("Task"):
            self.calls += 1
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
            return LLMResponse(content="found: 42")
        return LLMResponse(content="ok")


class _Worker:
    """An AgentLoop (not run) whose subagent jobs run under an arq Worker that polls only
    when the test says so (``poll``): the interleavings are chosen, not waited for."""

    def __init__(self, worker_id: str, client: aioredis.Redis, url: str, model: Model) -> None:
        from worker import AgentLoop, LoopConfig
        from worker.jobs.arq_queue import ArqJobQueue

        self.jobs = ArqJobQueue(url, "agent")
        self.loop = AgentLoop(
            RedisBus(client),
            ScriptedProvider(handler=model),
            jobs=self.jobs,
            config=LoopConfig(worker_id=worker_id),
        )
        self.arq: Any = None

    async def start(self) -> None:
        from arq import create_pool
        from arq.worker import Worker, func

        from worker.jobs.arq_queue import JOB_TIMEOUT_S, ArqJobQueue

        q = self.jobs
        self.arq = Worker(
            [func(ArqJobQueue._wrap(self.loop.subagents.run_job), name="subagent", keep_result=0)],
            queue_name=q.queue_name,
            redis_pool=await create_pool(q.settings, default_queue_name=q.queue_name),
            handle_signals=False,
            job_timeout=JOB_TIMEOUT_S,
            log_results=False,
        )

    async def poll(self, job_id: str) -> asyncio.Task[Any] | None:
        """One poll of arq's queue for ``job_id`` (as ``Worker._poll_iteration`` does)."""
        before = self.arq.tasks.get(job_id)
        await self.arq.start_jobs([job_id.encode()])
        task = self.arq.tasks.get(job_id)
        return task if task is not before else None

    async def close(self) -> None:
        for task in list(self.arq.tasks.values()) if self.arq else []:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        if self.arq is not None:
            await self.arq.pool.aclose()
        await self.jobs.aclose()
        await self.loop.bus.aclose()


async def _registered(real_redis: aioredis.Redis, w0: _Worker) -> str:
    """A subagent of SESSION registered (queued by w0) and its arq job queued."""
    await real_redis.set(K.lease(SESSION), "n|w0", px=60_000)
    doc = {"id": SID, "session": SESSION, "channel": "web", "chat_id": "rv", "scope": "web/u",
           "label": "r", "task": "slow", "state": "queued", "by": "w0", "after": "100-0"}  # fmt: skip
    store = w0.loop.subagents.store
    added = await store.add(SESSION, "n|w0", SESSION, SID, json.dumps(doc), limit=3,
                            channel_limit=8, scope="web/u", scope_limit=2)  # fmt: skip
    assert added == 1
    job_id = w0.loop.subagents._job_id(SID)
    await w0.jobs.enqueue("subagent", job_id=job_id, session=SESSION, sid=SID)
    return job_id


async def _spec(real_redis: aioredis.Redis) -> dict[str, Any] | None:
    raw = await real_redis.hget(K.spawned(SESSION), SID)
    return None if raw is None else json.loads(raw)


def _workers(url: str, model: Any) -> tuple[Any, Any]:
    return tuple(  # type: ignore[return-value]
        _Worker(w, aioredis.from_url(url, decode_responses=True), url, model) for w in ("w0", "w1")
    )


async def _started_on_w0(redis: aioredis.Redis, w0: Any, w1: Any) -> tuple[str, Any]:
    """Both workers up, the subagent registered by w0 and its job taken by w0's arq."""
    await w0.start()
    await w1.start()
    job_id = await _registered(redis, w0)
    stale = await w0.poll(job_id)
    assert stale is not None
    return job_id, stale


@pytest.mark.real_redis
async def test_a_superseded_run_ending_takes_the_survivors_requeued_job_with_it(
    real_redis, redis_server, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """w0 runs the subagent (arq job), stalls, is judged dead: w1 claims it (the run goes
    from the registration) and re-queues the job (``orphaned``: in-progress mark removed,
    the job still queued). w0 wakes before w1's arq polls: its run sees the claim and
    ends at once (superseded, nothing published) and arq finishes *the job*: it is
    removed from the queue. w1's poll then finds nothing: the subagent never runs again,
    its registration says running on w1 (alive, so nobody claims it again) for its hour,
    holding a slot, and the conversation never gets the result. (Before 93f8f97 the
    woken run went on and published.)"""
    monkeypatch.setattr("worker.jobs.subagents.WATCH_S", 0.05)
    model = Model()
    w0, w1 = _workers(redis_server.url, model)
    try:
        job_id, stale = await _started_on_w0(real_redis, w0, w1)
        await until(lambda: model.calls == 1, timeout_s=10)  # run 1, on w0, held
        # w0 judged dead (stalled): w1 claims its subagent and queues the job again
        assert await w1.loop.subagents.rerun_orphans("w0", ["web"]) == 1
        # w0 wakes: its run's next look sees the claim
        await asyncio.wait_for(stale, 10)
        assert model.cancelled == 1
        rerun = await w1.poll(job_id)  # w1's arq polls
        spec = await _spec(real_redis)
        assert rerun is not None, (
            f"the survivor's re-run never starts (job gone from arq's queue); left "
            f"registered: {spec}"
        )
    finally:
        model.release.set()
        await w0.close()
        await w1.close()


@pytest.mark.real_redis
async def test_the_stale_run_ending_unbooks_the_rerun_on_the_same_worker(
    real_redis, redis_server, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """w0 stalls while it runs the subagent; w1 claims it and re-queues the job; w0 wakes
    and its own arq poll takes the job again (arq keeps no record per job id: a second
    task) before the stale run's next look. The stale run then sees the new run named,
    ends, and its ``finally`` pops ``running[session][sid]``: the new run's entry. A stop
    of the session heard by w0 then does not cancel the new run (its model call runs to
    its end), though every worker is to cancel the subagents it runs."""
    model = Model()
    w0, w1 = _workers(redis_server.url, model)
    subagents = w0.loop.subagents
    gate = asyncio.Event()  # the stale run's look waits here: it comes after the re-run
    look = subagents.store.run_of

    async def gated(session: str, sid: str) -> str | None:
        await gate.wait()
        return await look(session, sid)

    subagents.store.run_of = gated  # type: ignore[method-assign]
    try:
        job_id, stale = await _started_on_w0(real_redis, w0, w1)
        await until(lambda: model.calls == 1, timeout_s=10)
        assert await w1.loop.subagents.rerun_orphans("w0", ["web"]) == 1
        again = await w0.poll(job_id)  # w0 woke: its arq polls first
        assert again is not None
        await until(lambda: model.calls == 2, timeout_s=10)  # the re-run, on w0, held
        [(new_task, _)] = subagents.running[SESSION].values()
        gate.set()
        monkeypatch.setattr("worker.jobs.subagents.WATCH_S", 0.05)
        await asyncio.wait_for(stale, 10)  # superseded: it ended
        assert model.cancelled == 1
        assert not new_task.done()
        # a stop of the session (after the spawning message) heard by w0
        subagents.on_control(ControlMessage(op="stop", session_key=SESSION, marker="200-0"))
        assert new_task.cancelling(), (
            "the stop left the re-run's model call running: running[session][sid] no "
            f"longer names it ({subagents.running})"
        )
    finally:
        model.release.set()
        await w0.close()
        await w1.close()


@pytest.mark.real_redis
async def test_a_job_taken_by_a_worker_that_died_before_starting_it_runs_again_at_once(
    real_redis, redis_server
) -> None:  # type: ignore[no-untyped-def]
    """w0 registered the subagent (``queued`` by w0, alive); w1's arq took its job (arq's
    in-progress mark, 15 minutes) and w1 stalled, then died, before the job marked the
    registration ``running``. No registration names w1, so when w0 judges w1 dead only
    w1's entry of the jobs it runs, written as the job's first step, tells w0 to run it
    again; before, the job waited out arq's mark."""
    model = Model()
    w0, w1 = _workers(redis_server.url, model)
    stalled = asyncio.Event()

    async def stall(*_a: Any) -> bool:
        stalled.set()
        await asyncio.Event().wait()  # w1 never goes on
        return False

    w1.loop.subagents.store.running = stall  # type: ignore[method-assign]
    try:
        await w0.start()
        await w1.start()
        job_id = await _registered(real_redis, w0)
        assert await w1.poll(job_id) is not None
        await asyncio.wait_for(stalled.wait(), 10)
        assert (await _spec(real_redis) or {}).get("state") == "queued"
        assert await w0.poll(job_id) is None  # arq's mark holds it
        await w0.loop.leftovers.rerun("w1", {"web"})  # w0's liveness watch judged w1 dead
        rerun = await w0.poll(job_id)
        assert rerun is not None, "the job w1 took waits out arq's in-progress mark"
        await until(lambda: model.calls == 1, timeout_s=10)  # the re-run, on w0
        assert (await _spec(real_redis) or {}).get("worker") == "w0"
    finally:
        model.release.set()
        await w0.close()
        await w1.close()
