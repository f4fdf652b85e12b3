"""Hostile review of c5d2441..88bf850 (a subagent job names itself in its worker's hash
of running jobs; a claimant whose re-queue fails gives the entries back). Each test
failed on 88bf850. Two more findings of the review (a former life's entries given back
into its own hash; an entry given back for a job that ended meanwhile on a worker that
was only stalled) were fixed later, by a worker's look at its own hash on every tick
(tests 5 and 6: each failed on 4dc8fca)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import redis.asyncio as aioredis
from helpers import ScriptedProvider
from replies import until
from test_failover_leftovers import _RefusingJobs
from test_second_reading_watch_and_runs import Model, _registered, _spec, _workers

from bus_redis import Keys
from worker.jobs.local import LocalJobQueue

K = Keys()


def _loop(redis: aioredis.Redis, jobs: Any, worker_id: str = "w1") -> Any:
    from bus_redis import RedisBus
    from worker import AgentLoop, LoopConfig

    return AgentLoop(
        RedisBus(redis), ScriptedProvider(), jobs=jobs, config=LoopConfig(worker_id=worker_id)
    )


def _subagent_doc(state: str, **more: Any) -> str:
    doc = {"id": "s3", "session": "web:c", "channel": "web", "chat_id": "c", "scope": "web/u",
           "label": "l", "task": "t", "state": state, "after": "1-0", **more}  # fmt: skip
    return json.dumps(doc)


# --- 1. a give-back after the registration was claimed ---------------------------------
async def test_a_started_subagent_whose_requeue_failed_is_queued_again_at_the_next_look(
    redis: aioredis.Redis,
) -> None:
    """Worker ``w-dead`` ran subagent s3 (registration ``running`` on w-dead, and its
    entry in w-dead's running-jobs hash). The survivor claims the entry, then the
    registration (``claim_orphan``: the registration now names the survivor, no run),
    and its re-queue fails: the entry is given back "for the next look". But the next
    look (the prune of w-dead's record) finds the registration naming the survivor, not
    w-dead, takes it as "running again elsewhere" and drops the entry; the registration
    path's ``claim_orphan(dead)`` fails as well. So the subagent is never queued again:
    its registration says running on a live worker (nobody claims it again) and the job
    waits out arq's in-progress mark (15 minutes), which the give-back was to avoid.
    Expected: the next look queues the job again."""
    from bus_redis import RedisBus
    from bus_redis.running_jobs import RunningJobs

    bus = RedisBus(redis)
    dead = RunningJobs(bus, "w-dead", ttl_ms=60_000, kind="subagents")
    await dead.started("agent:subagent:s3", "subagent", "web", {"session": "web:c", "sid": "s3"})
    await redis.hset(K.spawned("web:c"), "s3", _subagent_doc("running", worker="w-dead", run="r"))
    await redis.zadd(K.subagents("web"), {"web:c": 1})
    jobs = _RefusingJobs(fail=1)
    loop = _loop(redis, jobs)
    await loop.leftovers.rerun("w-dead", {"web"})  # refused once: logged
    assert jobs.orphans == []
    await loop.leftovers.rerun("w-dead", {"web"})  # the next look (the prune of its record)
    spec = json.loads(await redis.hget(K.spawned("web:c"), "s3"))
    assert jobs.orphans == ["agent:subagent:s3"], (
        f"the subagent is never queued again; its registration says {spec.get('state')} "
        f"on {spec.get('worker')} (run {spec.get('run')!r}), its entry is gone: "
        f"{await redis.hgetall(K.worker_jobs('w-dead', 'subagents'))}"
    )


class _StalledStart:
    """A worker's first subagent start stalls (before it marks the registration
    ``running``) until ``wake``; each start's outcome goes to ``starts``."""

    def __init__(self, worker: Any) -> None:
        self.stalled, self.wake = asyncio.Event(), asyncio.Event()
        self.starts: list[bool] = []
        self.running = worker.loop.subagents.store.running
        worker.loop.subagents.store.running = self

    async def __call__(self, *a: Any) -> bool:
        if not self.stalled.is_set():
            self.stalled.set()
            await self.wake.wait()
        ok: bool = await self.running(*a)
        self.starts.append(ok)
        return ok


async def _taken_by_stalled(real_redis: aioredis.Redis, w0: Any, w1: Any) -> tuple[str, Any]:
    """Both workers up, a subagent registered by w0, its job taken by w1's arq, and w1
    stalled before its start marked it ``running``; w0 judged w1 dead (its liveness
    watch) and queued the job again."""
    stall = _StalledStart(w1)
    await w0.start()
    await w1.start()
    job_id = await _registered(real_redis, w0)
    first = await w1.poll(job_id)
    assert first is not None
    await asyncio.wait_for(stall.stalled.wait(), 10)
    await w0.loop.leftovers.rerun("w1", {"web"})
    return job_id, (first, stall)


# --- 2. a stalled worker that wakes up after the survivor's re-run started -------------
@pytest.mark.real_redis
async def test_a_woken_worker_does_not_take_over_the_rerun_of_the_job_it_took(
    real_redis, redis_server, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """w0 registered the subagent (``queued`` by w0); w1's arq took its job and w1
    stalled before marking it ``running``. w0 judged w1 dead, claimed w1's entry and
    queued the job again (new in this change), and w0's re-run started (``running`` on
    w0, its run named, its model call made). Then w1 wakes up: its start writes
    ``running`` on w1 over the registration (``spawn_done.lua``'s 'running' is a plain
    HSET), so w0's run is superseded and cancelled while the stale worker, judged dead,
    runs the subagent from the start: every model call made so far is paid twice (and
    with a survivor that claimed a ``running`` registration this is fenced: the woken
    run sees its run gone). Expected: the woken worker's start is refused (the take was
    claimed), the re-run goes on, one model call in all."""
    monkeypatch.setattr("worker.jobs.subagents.WATCH_S", 0.05)
    model = Model()
    w0, w1 = _workers(redis_server.url, model)
    try:
        job_id, (_, stall) = await _taken_by_stalled(real_redis, w0, w1)
        assert await w0.poll(job_id) is not None
        await until(lambda: model.calls == 1, timeout_s=10)  # the re-run, on w0, held
        assert (await _spec(real_redis) or {}).get("worker") == "w0"
        stall.wake.set()  # w1 wakes up
        await until(lambda: len(stall.starts) == 1, timeout_s=10)
        assert stall.starts == [False], (
            f"the woken worker started the subagent over the survivor's re-run: "
            f"{await _spec(real_redis)}"
        )
        assert (await _spec(real_redis) or {}).get("worker") == "w0"
        assert model.cancelled == 0
        assert model.calls == 1
    finally:
        model.release.set()
        await w0.close()
        await w1.close()


# --- 3. a rolling upgrade: an older survivor ------------------------------------------
async def test_an_older_survivor_queues_a_dead_workers_subagent_again_once(
    redis: aioredis.Redis,
) -> None:
    """During a rolling upgrade an older worker (7a99514) judges a new one dead. The new
    worker's subagent job named itself in ``P:worker:<id>:jobs``, a hash the older
    worker reads as its consolidations: its ``Consolidator.rerun_orphans`` claims every
    entry of the dead worker (``RunningJobs.claim(dead, channels)``, no name) and
    queues each again, unchecked; its ``Subagents.rerun_orphans`` has already claimed
    the same subagent from its registration and queued it. So one survivor's look
    queues a running subagent twice; with arq the second ``orphaned`` deletes the
    in-progress mark of a re-run that started in between, and a third worker runs it
    again at once (model calls paid twice). Expected: the older worker's look queues
    it once (e.g. subagent entries under a key older workers do not read)."""
    from bus_redis import RedisBus
    from bus_redis.running_jobs import RunningJobs
    from worker.jobs.subagents import JOB_NAME

    bus = RedisBus(redis)
    await redis.set(K.lease("web:c"), "n|w-dead", px=60_000)
    store = _loop(redis, LocalJobQueue(), worker_id="w-dead").subagents.store
    assert await store.add("web:c", "n|w-dead", "web:c", "s3", _subagent_doc("queued", by="w-dead"),
                           limit=3, channel_limit=8, scope="web/u", scope_limit=2) == 1  # fmt: skip
    new = _loop(redis, LocalJobQueue(), worker_id="w-dead")  # the new worker, about to die
    held = asyncio.Event()

    async def running(*a: Any) -> bool:
        ok = await store_running(*a)
        held.set()
        await asyncio.Event().wait()  # it dies here, its subagent running
        return ok

    store_running = new.subagents.store.running
    new.subagents.store.running = running  # type: ignore[method-assign]
    job = asyncio.create_task(new.subagents.run_job(session="web:c", sid="s3"))
    try:
        await asyncio.wait_for(held.wait(), 10)
        # the older survivor's look (7a99514's AgentLoop._rerun_left, now Leftovers.rerun): its subagents ...
        jobs = _RefusingJobs(fail=0)
        old = _loop(redis, jobs, worker_id="w-old")
        job_id = old.subagents._job_id("s3")
        assert await old.subagents.store.claim_orphan("web:c", "s3", "w-dead", "w-old")
        await jobs.orphaned(JOB_NAME, job_id=job_id, session="web:c", sid="s3")
        # ... then its consolidations (7a99514's Consolidator.rerun_orphans, verbatim)
        claimed = await RunningJobs(bus, "w-old", ttl_ms=60_000).claim("w-dead", {"web"})
        for claimed_id, name, kwargs in claimed:
            await jobs.orphaned(name, job_id=claimed_id, **kwargs)
        assert jobs.orphans == [job_id], f"queued again {len(jobs.orphans)} times"
    finally:
        job.cancel()
        await asyncio.gather(job, return_exceptions=True)


# --- 4. unified mode: the prune's look leaves the unified channel out ------------------
async def test_in_unified_mode_the_prune_claims_what_was_given_back(
    redis: aioredis.Redis,
) -> None:
    """In unified mode every durable session is ``unified:default``: its jobs' entries
    are of channel ``unified``. The liveness watch looks at a dead worker with that
    channel, but the maintenance tick's prune (``Maintenance._prune_workers``, the "next
    look" a give-back counts on) passes only ``self.channels``, without ``unified``
    (the tick adds it everywhere else). So an entry given back after a refused re-queue
    is never claimed again: the dead worker's consolidation (and, new here, a subagent
    it had taken) waits out arq's in-progress mark. Expected: the prune claims it."""
    from bus_redis import RedisBus
    from bus_redis.running_jobs import RunningJobs
    from worker import AgentLoop, LoopConfig

    dead = RunningJobs(RedisBus(redis), "w-dead", ttl_ms=60_000)
    kwargs = {"key": "unified:default", "start": 0, "end": 4}
    await dead.started("agent:consolidate:unified:default", "consolidate", "unified", kwargs)
    await redis.zadd(K.workers, {"w-dead": 1})  # its heartbeat, long stopped
    jobs = _RefusingJobs(fail=1)
    config = LoopConfig(worker_id="w1", unified_session=True, channels=["web"])
    loop = AgentLoop(RedisBus(redis), ScriptedProvider(), jobs=jobs, config=config)
    await loop.maintenance.refresh_channels(discover=False)
    # the liveness watch judged w-dead dead: its look (all served channels) is refused
    await loop.leftovers.rerun("w-dead", loop._served_channels())
    assert await redis.hexists(K.worker_jobs("w-dead"), "agent:consolidate:unified:default")
    await loop.maintenance._prune_workers()  # the next look: the prune of its record
    assert not await redis.zscore(K.workers, "w-dead")  # (pruned)
    assert jobs.orphans == ["agent:consolidate:unified:default"], (
        f"the prune left it: {await redis.hgetall(K.worker_jobs('w-dead'))}"
    )


# --- 5. a former life's job whose re-queue failed at start --------------------------------
async def test_a_former_lifes_job_refused_at_start_is_queued_again_by_a_tick(
    redis: aioredis.Redis,
) -> None:
    """Worker w1 was killed while it ran a consolidation and was restarted under its id.
    Its start queues its former life's jobs again; Redis refuses that, so the entry goes
    back into w1's own hash, which only a survivor judging w1 dead would read: none
    does (w1 lives), and the job waits out arq's in-progress mark (15 minutes).
    Expected: w1's next maintenance tick queues it."""
    from bus_redis import RedisBus
    from bus_redis.running_jobs import RunningJobs

    former = RunningJobs(RedisBus(redis), "w1", ttl_ms=60_000)
    kwargs = {"key": "web:c", "start": 0, "end": 4}
    await former.started("agent:consolidate:web:c", "consolidate", "web", kwargs)
    jobs = _RefusingJobs(fail=1)
    loop = _loop(redis, jobs)
    await loop.leftovers.rerun("w1", {"web"})  # the start's look: refused, given back
    assert jobs.orphans == []
    await loop.maintenance.refresh_channels(discover=True)
    await loop.maintenance.tick()
    assert jobs.orphans == ["agent:consolidate:web:c"], (
        f"the tick left it: {await redis.hgetall(K.worker_jobs('w1'))}"
    )
    assert not await redis.hexists(K.worker_jobs("w1"), "agent:consolidate:web:c")


# --- 6. an entry given back to a worker that was only stalled ---------------------------
async def test_an_entry_given_back_to_a_woken_worker_is_looked_at_and_a_running_one_kept(
    redis: aioredis.Redis,
) -> None:
    """w2 judged w1 (only stalled) dead and claimed its two subagent entries; its
    re-queue was refused and it gave both back. Meanwhile w1 woke: one job had ended
    (its registration gone), the other still runs. The ended job's entry stayed in w1's
    hash until w1 died for real (no survivor looks at a live worker). Expected: w1's
    tick drops the ended job's entry (its registration is gone: nothing to queue) and
    keeps the running job's, queueing nothing."""
    from bus_redis import RedisBus
    from bus_redis.running_jobs import RunningJobs

    jobs = _RefusingJobs(fail=0)
    loop = _loop(redis, jobs)
    here = loop.subagents.here
    kwargs = {"session": "web:c", "sid": "s3"}
    await here.started("agent:subagent:s3", "subagent", "web", kwargs)  # still runs
    await redis.hset(K.spawned("web:c"), "s3", _subagent_doc("running", worker="w1", run="r"))
    survivor = RunningJobs(RedisBus(redis), "w2", ttl_ms=60_000, kind="subagents")
    ended = {"session": "web:c", "sid": "s4"}
    for job_id, args in (("agent:subagent:s3", kwargs), ("agent:subagent:s4", ended)):
        await survivor.give_back("w1", job_id, "subagent", "web", args)  # (after the stall)
    await loop.maintenance.refresh_channels(discover=True)
    await loop.maintenance.tick()
    assert jobs.orphans == []  # s4 ended, s3 runs here
    left = await redis.hgetall(K.worker_jobs("w1", "subagents"))
    assert set(left) == {"agent:subagent:s3"}, f"w1's hash after its tick: {left}"


async def test_a_job_that_starts_here_while_its_old_entry_is_claimed_keeps_its_entry(
    redis: aioredis.Redis,
) -> None:
    """The look at the own hash reads an old entry of a job id not running here; that
    job starts here (its entry written) before the claim's ``HDEL`` arrives. The claim
    must put the running job's entry back and not queue it: the entry covers the run
    should this worker die."""
    from bus_redis import RedisBus
    from bus_redis.running_jobs import RunningJobs

    running = RunningJobs(RedisBus(redis), "w1", ttl_ms=60_000)
    kwargs = {"key": "web:c", "start": 0, "end": 4}
    await running.give_back("w1", "agent:consolidate:web:c", "consolidate", "web", kwargs)
    hdel = running.redis.hdel

    async def started_first(*args: Any) -> int:
        await running.started("agent:consolidate:web:c", "consolidate", "web", kwargs)
        return await hdel(*args)  # type: ignore[no-any-return]

    running.redis.hdel = started_first  # type: ignore[method-assign]
    assert await running.claim("w1", {"web"}) == []
    running.redis.hdel = hdel  # type: ignore[method-assign]
    assert await redis.hexists(K.worker_jobs("w1"), "agent:consolidate:web:c")
    await running.ended("agent:consolidate:web:c")
    assert not await redis.hexists(K.worker_jobs("w1"), "agent:consolidate:web:c")


# --- 7. the re-run of a job taken from a stalled worker lands on that worker ------------
@pytest.mark.real_redis
async def test_the_rerun_of_a_taken_job_runs_on_the_worker_it_was_taken_from(
    real_redis, redis_server, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """As in test 2, w1's arq took the subagent's job and w1 stalled before marking it
    ``running``; w0 judged w1 dead, marked the registration taken from w1 and queued the
    job again. w1 wakes: its stalled start is refused (right). But the re-run is a job
    like any other, and w1's arq may be the one that takes it. Two defects (failed on
    d138b5f): the refused run returned at once, and the job queue dropped the job, the
    re-run with it (one job id); and a re-run taken by w1 was refused as well
    (``taken_from`` named the worker, not the stalled run). Either way the subagent
    never ran and its registration stayed ``queued`` for its hour. Expected: the refused
    run waits for the re-run to start; only the stalled run is refused, and the re-run
    starts on w1."""
    monkeypatch.setattr("worker.jobs.subagents.WATCH_S", 0.05)
    model = Model()
    w0, w1 = _workers(redis_server.url, model)
    try:
        job_id, (first, stall) = await _taken_by_stalled(real_redis, w0, w1)
        stall.wake.set()  # w1 wakes: the stalled start is refused
        await until(lambda: stall.starts == [False], timeout_s=10)
        rerun = await w1.poll(job_id)  # w1's arq takes the re-run
        assert rerun is not None, "the re-run is gone: the refused run's end dropped the job"
        await until(lambda: len(stall.starts) == 2, timeout_s=10)
        assert stall.starts == [False, True], f"the re-run was refused: {await _spec(real_redis)}"
        await until(lambda: model.calls == 1, timeout_s=10)
        await asyncio.wait_for(first, 10)  # the refused run ended once the re-run started
    finally:
        model.release.set()
        await w0.close()
        await w1.close()
