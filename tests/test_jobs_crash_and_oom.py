"""Scheduled jobs and subagents against a crash and a full Redis, as a hostile reviewer
attacked them: a schedule made by a first turn whose worker died, a subagent started at OOM."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import UTC, datetime
from typing import Any

import pytest
import redis.asyncio as aioredis
from helpers import ScriptedProvider
from replies import channel_events, collect, until

from bus_redis import FrontendClient, InboundMessage, Keys, RedisBus
from session_store import RedisSessionStore
from worker import AgentLoop

K = Keys()


async def _gone(redis: aioredis.Redis, key: str) -> bool:
    return await redis.exists(key) == 0


# --- a crash in a session's first turn loses the schedule that turn made ------------------


@pytest.mark.real_redis
@pytest.mark.slow
async def test_a_schedule_made_by_a_crashed_first_turn_survives_until_the_turn_is_rerun(
    real_redis, spawn_workers
) -> None:  # type: ignore[no-untyped-def]
    """A new chat's first turn adds a one-shot schedule; its worker is killed (kill -9)
    after the cron call was journaled, before the commit. Until the message is delivered
    again nothing is stored under the session, and its lease runs out: any live worker's
    maintenance sweep (or the firing's arq job) that runs in that window takes the
    schedule for one "never stored" and drops it (cron_fire.lua: no hash, no lease). The
    re-run then replays the journaled "Scheduled ..." result without running the tool, and
    commits a history that says the reminder is set while it is gone: the README's
    "delivered once ... across restarts" and "tool effects at most once" (its recorded
    result is used) are both broken, silently."""
    [doomed] = spawn_workers(
        1, env={"AGENT_FAULT_POINTS": "tool_recorded", "AGENT_LOCK_TTL_MS": "1000"}
    )
    client = FrontendClient(real_redis)
    # due soon (an `at` more than a second past is refused: the worker's start may take that)
    at = datetime.fromtimestamp(time.time() + 5, UTC).isoformat()
    add = json.dumps({"action": "add", "at": at, "message": "take the cake out"})
    await client.send(
        InboundMessage(id="m1", channel="web", chat_id="cake", sender_id="u",
                       content=f"toolcall:cron{add}")
    )  # fmt: skip
    assert doomed.proc.wait(timeout=30) == 137  # died with the call journaled
    key = "web:cake"
    [sid] = await real_redis.smembers(K.crons(key))
    due = int(await real_redis.zscore(K.cron_due("web"), sid))
    # the dead worker's lease runs out (nobody else is serving yet)
    await until(lambda: _gone(real_redis, K.lease(key)), timeout_s=30)
    # another live worker's maintenance tick comes first (here: in this process)
    other = AgentLoop(RedisBus(real_redis), ScriptedProvider([]))
    await other.schedules.fire(channel="web", sid=sid, due_ms=due)
    await other.jobs.aclose()
    # the message is delivered again and its turn is re-run from the journal
    spawn_workers(1)
    got = await collect(client, "web", {"m1"}, timeout_s=30)
    assert [e.type for e in got["m1"] if e.is_terminal] == ["message"]
    stored = await RedisSessionStore(real_redis, K).load(key)
    assert stored is not None
    tool_rows = [r for r in stored.messages if r.get("role") == "tool"]
    assert tool_rows[0]["content"].startswith(f"Scheduled {sid}")  # what the user was told
    # ... so the reminder must still be there, or have fired into the session (a one-shot
    # firing leaves the definitions before its own turn is answered: wait for that answer)

    async def kept_or_fired() -> bool:
        events = await channel_events(client, "web")
        fired = [e for e in events if (e.reply_to or "").startswith(f"cron:{sid}:")]
        return bool(fired) or await real_redis.hget(K.cron_defs("web"), sid) is not None

    try:
        await until(kept_or_fired, timeout_s=20)
    except AssertionError:
        raise AssertionError("the schedule the history says was set is gone") from None


# --- a subagent job that meets a full Redis when it starts is lost --------------------------


async def _oom_errors(redis: aioredis.Redis) -> int:
    stats = await redis.info("errorstats")
    return int((stats.get("errorstat_OOM") or {}).get("count", 0))


@pytest.mark.real_redis
async def test_a_subagent_whose_start_meets_a_full_redis_still_reports_back(real_redis) -> None:  # type: ignore[no-untyped-def]
    """The job's first write (``running``: spawn_done.lua's HSET) is refused at maxmemory
    and ``run_job`` raises it. arq does not retry a job that raised (only ``Retry``,
    timeouts and cancellation), and no sweep looks for registered subagents without a job:
    the subagent never runs, its session never hears of it (not even the failure note the
    docs promise for "any error"), and its registration holds the session's and the
    channel's slots for an hour. The publish of its result survives the same OOM (it is
    retried for a minute); its start does not. Threat model: nothing is lost by a full
    Redis."""

    async def answer(**_kw: Any) -> Any:
        from worker.agent.providers import LLMResponse

        return LLMResponse(content="found: 42")

    loop = AgentLoop(RedisBus(real_redis), ScriptedProvider(handler=answer))
    store = loop.subagents.store
    session = "web:oom"
    await real_redis.set(K.lease(session), "n|w", px=10_000)
    doc = {"id": "sa", "session": session, "channel": "web", "chat_id": "oom",
           "scope": "web/sender:u", "label": "r", "task": "find it", "after": "1-0"}  # fmt: skip
    assert await store.add(session, "n|w", session, "sa", json.dumps(doc), limit=2,
                           channel_limit=8, scope="web/u", scope_limit=2) == 1  # fmt: skip
    before = await _oom_errors(real_redis)
    await real_redis.config_set("maxmemory", "1")
    try:
        job = asyncio.create_task(loop.subagents.run_job(session=session, sid="sa"))
        await until(lambda: _more_oom(real_redis, before), timeout_s=10)
    finally:
        await real_redis.config_set("maxmemory", "0")
    await until(lambda: job.done(), timeout_s=30)
    failure = job.exception()
    await loop.jobs.aclose()
    assert failure is None, f"the subagent job died at its start: {failure!r}"
    rows = await real_redis.xrange(K.inbound(session))
    assert rows, "its result (or failure) never reached the session"


async def _more_oom(redis: aioredis.Redis, before: int) -> bool:
    return await _oom_errors(redis) > before


# --- a worker started while Redis is full -------------------------------------------------
@pytest.mark.real_redis
async def test_a_worker_started_while_redis_is_full_waits_and_then_serves(
    real_redis, spawn_workers
) -> None:  # type: ignore[no-untyped-def]
    """Its start writes (the worker record, the beat, the consumer groups): refused at
    maxmemory, the worker used to exit, so a fleet restarted while Redis was full stayed
    down after memory was freed. It waits with backoff, as for a Redis it cannot reach."""
    before = await _oom_errors(real_redis)
    await real_redis.config_set("maxmemory", "1")
    try:
        (worker,) = spawn_workers(1)

        async def refused_twice_or_exited() -> bool:
            return worker.proc.poll() is not None or await _more_oom(real_redis, before + 1)

        await until(refused_twice_or_exited, timeout_s=20)
        assert worker.proc.poll() is None, f"the worker exited:\n{worker.log()[-2000:]}"
    finally:
        await real_redis.config_set("maxmemory", "0")
    msg = InboundMessage(channel="web", sender_id="u", chat_id="full", content="hello")
    reply = await FrontendClient(real_redis).ask(msg, timeout_s=20)
    assert reply.content
