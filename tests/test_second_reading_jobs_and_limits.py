"""Second (hostile) review of the changes after 610a60c: running jobs of a dead worker,
consolidation in parts, the session tools' tail read, cron expressions' minimum repeat and
the per-scope share of subagent sessions. Each test states a defect found on review (it
fails on the reviewed commit) and the behaviour expected."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from itertools import pairwise
from typing import Any

import pytest
import redis.asyncio as aioredis
from arq.constants import in_progress_key_prefix
from cronsim import CronSim
from helpers import ScriptedProvider, Spawner
from replies import collect, spawn_replies

from bus_redis import FrontendClient, InboundMessage, Keys, RedisBus
from bus_redis.subagents import SubagentStore
from worker import AgentLoop, LoopConfig
from worker.jobs.arq_queue import JOB_TIMEOUT_S, ArqJobQueue
from worker.jobs.schedule_rules import ScheduleError, parse_schedule

K = Keys()


# --- 1. a subagent left 'queued' by a dead worker whose own job queue had taken it ------


@pytest.mark.real_redis
async def test_a_queued_subagent_whose_dead_worker_had_taken_its_job_runs_once_taken_over(
    real_redis: aioredis.Redis, redis_server: Any
) -> None:
    """Defect: ``Subagents.rerun_orphans`` handles a registration left ``queued`` by the
    dead worker with ``self.rt.jobs.enqueue`` (worker/jobs/subagents.py, the
    ``_queued_by(raw) == dead`` branch). The job usually *was* queued: the window the
    branch is meant for also holds the case where the worker's own arq had already taken
    the job (arq's in-progress key set for JOB_TIMEOUT_S, 15 minutes) and the process was
    killed before ``run_job`` marked the registration ``running`` (two round trips
    normally; about a minute while Redis is full and ``_retried`` keeps trying the start).
    arq refuses the enqueue of an id it still holds (the job key exists), the in-progress
    key stays, and the subagent's result waits the 15 minutes this change set out to
    remove (the session's slot, and the user's share, held all that time). Expected: a
    'queued' registration of a dead worker is handed over like a 'running' one
    (``jobs.orphaned``: arq's in-progress mark dropped), so the result arrives at once.
    Here the worker restarted under its id (``_start`` calls ``leftovers.rerun`` the same way
    a survivor's liveness watch does)."""
    jobs = ArqJobQueue(redis_server.url, "agent")
    model = Spawner()
    config = LoopConfig(read_block_ms=100, followup_mode="queue", worker_id="w-review")
    loop = AgentLoop(RedisBus(real_redis), ScriptedProvider(handler=model), jobs=jobs,
                     config=config)  # fmt: skip
    real_enqueue, taken = jobs.enqueue, []

    async def enqueue(name: str, **kw: Any) -> bool:
        if name == "subagent" and not taken:
            taken.append(kw["job_id"])
            # the worker's own arq took the job (its in-progress mark, arq's timeout long)
            # and the process was killed before the job marked the registration running
            await real_redis.set(in_progress_key_prefix + kw["job_id"], b"1",
                                 px=JOB_TIMEOUT_S * 1000)  # fmt: skip
        return bool(await real_enqueue(name, **kw))

    jobs.enqueue = enqueue  # type: ignore[method-assign]
    client = FrontendClient(aioredis.from_url(redis_server.url, decode_responses=True))
    task = asyncio.create_task(loop.run())
    try:
        msg = InboundMessage(id="q1", channel="web", chat_id="held", sender_id="u",
                             content="research one")  # fmt: skip
        await client.send(msg)
        await collect(client, "web", {"q1"}, timeout_s=10)
        assert taken, "no subagent job was queued"
        assert not await spawn_replies(client, "web:held")
        # what a restart under this id (or a survivor judging it dead) does
        await loop.leftovers.rerun(loop.worker_id, {"web"})
        deadline = asyncio.get_running_loop().time() + 6
        while not await spawn_replies(client, "web:held"):
            if asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.05)  # poll: arq runs the job in its own task
        left = await real_redis.pttl(in_progress_key_prefix + taken[0])
        registered = await real_redis.hgetall(K.spawned("web:held"))
        assert await spawn_replies(client, "web:held"), (
            f"no subagent result after the takeover: arq still holds the job for {left} ms, "
            f"the registration stays {registered}"
        )
    finally:
        loop.stop()
        await asyncio.wait_for(task, 20)
        await client.redis.aclose()


# --- 2. a cron expression's closest firings outside its first 64 ----------------------


def test_a_cron_expression_whose_closest_firings_come_late_in_a_busy_day_is_refused() -> None:
    """Defect: ``closest_firings`` (worker/jobs/schedules.py) looks at the next 64 firings
    only, from the moment of the ``add``. A day with more firings than that (possible as
    soon as ``AGENT_CRON_MIN_EVERY_S`` is above a minute, the only case the check is for)
    hides its closest pair when it comes late in the day: here six minutes an hour,
    otherwise 10 minutes apart, at hours 0, 2, ..., 22 and 23, so 22:55 and 23:00 are five
    minutes apart every day, after 66 firings from midnight. An operator's minimum of
    ten minutes is passed by a schedule firing five minutes apart. Expected: refused (the
    gaps of a whole day and across midnight are looked at, e.g. firings until two days
    passed or more than 2 x 86400 / minimum were seen)."""
    expr = "0,10,20,30,40,55 0,2,4,6,8,10,12,14,16,18,20,22,23 * * *"
    start = datetime(2024, 1, 1, 0, 0, 30, tzinfo=UTC)
    it = CronSim(expr, start)
    firings = [next(it) for _ in range(200)]
    shortest = min((b - a).total_seconds() for a, b in pairwise(firings))
    assert shortest == 300  # (the expression does fire five minutes apart)
    now = int(start.timestamp() * 1000)
    args = {"message": "m", "cron_expr": expr}
    with pytest.raises(ScheduleError):
        parse_schedule(args, sid="s", session="web:c", chat_id="c", min_every_s=600, now=now)


# --- 3. the scope count over a large channel index -----------------------------------


@pytest.mark.real_redis
async def test_a_spawn_in_a_channel_with_many_sessions_with_subagents_is_not_a_script_error(
    real_redis: aioredis.Redis,
) -> None:
    """Defect: ``spawn_add.lua`` now counts the scope's share with ``HMGET KEYS[4]
    unpack(members)`` over the whole channel index (and ``ZREM``/``HDEL
    unpack(expired)``). Lua's ``unpack`` fails above about 8,000 values ("too many results
    to unpack"), and ``AGENT_SUBAGENT_SESSIONS_PER_CHANNEL`` has no upper bound: an
    operator of a large channel who raised it to 20,000 gets every spawn of a new session
    refused with a script error once 8,000 sessions run subagents (before the change the
    script used ``ZCARD`` and worked). Expected: the spawn is registered (count the share
    without unpacking the index: a per-scope counter, or HMGET in chunks; or bound the
    setting)."""
    store = SubagentStore(RedisBus(real_redis))
    now_ms = int((await real_redis.time())[0]) * 1000
    members = {f"web:busy{i}": now_ms for i in range(8200)}
    await real_redis.zadd(K.subagents("web"), members)
    await real_redis.hset(K.subagent_scopes("web"), mapping=dict.fromkeys(members, "web/scope:x"))
    await real_redis.set(K.lease("web:new"), "tok")
    added = await store.add(
        "web:new", "tok", "web:new", "sid1", '{"state": "queued"}', limit=2,
        channel_limit=20_000, scope="web/scope:alice", scope_limit=2,
    )  # fmt: skip
    assert added == 1


@pytest.mark.real_redis
async def test_closing_the_job_queue_survives_arqs_close_raising_a_job_tasks_cancel(
    redis_server, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """(A CI run, stop 51.) arq's ``Worker.close`` cancels its job tasks and gathers them:
    one cancelled while finishing raised ``CancelledError`` out of the close, out of the
    worker's shutdown and into whoever awaited ``run()``. The job queue's close takes it
    as arq's, still closes arq's pool, and lets a cancellation of its own caller through."""
    from arq.worker import Worker

    jobs = ArqJobQueue(redis_server.url, "agent")
    jobs.register("noop", _noop)
    await jobs.start()
    real_close, closed = Worker.close, []

    async def close(self: Worker) -> None:
        closed.append(self._pool)
        raise asyncio.CancelledError  # (as arq's gather of a job cancelled mid-finish)

    monkeypatch.setattr(Worker, "close", close)
    await jobs.aclose()  # no CancelledError
    assert closed
    assert jobs._worker is not None
    assert jobs._worker._pool is None  # the pool went all the same
    monkeypatch.setattr(Worker, "close", real_close)


async def _noop(**_: object) -> None:
    return None
