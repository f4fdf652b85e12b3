"""Scheduled turns (the ``cron`` tool, ``worker.jobs.schedules``): what a schedule may be,
when it fires next (missed firings coalesce), a firing delivered once whoever fires it,
end to end in-process on fakeredis and a real redis-server, deletion with the session;
three worker processes and a restart on a real one."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from datetime import UTC, datetime
from typing import Any

import pytest
import redis.asyncio as aioredis
from helpers import ScriptedProvider, run_cli
from redis.exceptions import ResponseError
from replies import channel_events, collect, until

from bus_redis import FrontendClient, InboundMessage, Keys, RedisBus
from bus_redis.schedules import ScheduleStore
from worker import AgentLoop, LoopConfig
from worker.agent.providers import LLMResponse, ToolCallRequest
from worker.jobs import LocalJobQueue
from worker.jobs.schedule_rules import Schedule, ScheduleError, parse_schedule

K = Keys()
NOW = int(datetime(2026, 3, 28, 12, 0, tzinfo=UTC).timestamp() * 1000)


def _parse(**args: Any) -> Schedule:
    return parse_schedule(
        {"message": "m", **args}, sid="s", session="web:c", chat_id="c", min_every_s=60, now=NOW
    )


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ({}, "exactly one of"),
        ({"every_seconds": 10}, "between 60"),
        ({"every_seconds": 90.5}, "whole number"),
        ({"cron_expr": "every day"}, "not a cron expression"),
        ({"cron_expr": "0 9 * * *", "tz": "Mars/Olympus"}, "unknown time zone"),
        ({"at": "yesterday"}, "ISO 8601"),
        ({"at": "2026-03-27T12:00:00+00:00"}, "in the past"),
        ({"at": "2027-06-01T12:00:00+00:00"}, "366 days ahead"),
        ({"every_seconds": float("inf")}, "whole number"),
        ({"at": "2026-03-29T12:00", "every_seconds": 60}, "exactly one of"),
        ({"message": "  ", "every_seconds": 60}, "non-empty"),
        ({"message": "x" * 2001, "every_seconds": 60}, "longer than"),
    ],
)
def test_what_cannot_be_scheduled_is_refused_with_a_reason(args: dict[str, Any], says: str) -> None:
    with pytest.raises(ScheduleError, match=says):
        _parse(**args)


def test_missed_firings_coalesce_into_one_and_the_next_is_after_now() -> None:
    every = _parse(every_seconds=60)
    assert every.first_due(NOW) == NOW + 60_000
    due = NOW + 60_000
    assert every.next_due(due, due) == due + 60_000  # on time
    assert every.next_due(due, due + 150_000) == due + 180_000  # 2 missed: skipped, not replayed
    once = _parse(at="2026-03-28T13:00:00+01:00")  # naive or not, the given zone counts
    assert once.first_due(NOW) == NOW
    assert once.next_due(NOW, NOW) is None


def test_cron_expressions_follow_their_time_zone_across_daylight_saving() -> None:
    daily = _parse(cron_expr="0 9 * * *", tz="Europe/Berlin")
    first = daily.first_due(NOW)  # the 29th at 09:00 CEST (DST began that night)
    second = daily.next_due(first, first)
    assert datetime.fromtimestamp(first / 1000, UTC).hour == 7
    assert second - first == 86_400_000
    winter = _parse(cron_expr="0 9 * * *", tz="Europe/Berlin").first_due(NOW - 86_400_000 * 2)
    assert datetime.fromtimestamp(winter / 1000, UTC).hour == 8  # the 27th, still CET


def test_in_the_hour_clocks_go_back_every_next_firing_is_later() -> None:
    """America/New_York repeats 01:00-02:00 on 2026-11-01: a firing computed inside that
    hour must not name the earlier 01:30 again (the schedule would never move on)."""
    nightly = _parse(cron_expr="30 1 * * *", tz="America/New_York")
    at = int(datetime(2026, 11, 1, 6, 0, tzinfo=UTC).timestamp() * 1000)  # 01:00 EST
    due = nightly.next_due(at, at)
    assert due is not None
    assert due > at
    for _ in range(5):
        nxt = nightly.next_due(due, due)
        assert nxt is not None
        assert nxt > due
        due = nxt


async def _add(
    store: ScheduleStore, redis: aioredis.Redis, session: str, every_s: int, sid: str = "s1"
) -> int:
    sched = Schedule(
        id=sid, session=session, channel="web", chat_id=session.split(":", 1)[1],
        message="tick", kind="every", every_s=every_s, created_ms=0,
    )  # fmt: skip
    await redis.set(K.lease(session), "n|w", px=10_000)
    due = int(time.time() * 1000) - 1  # due now
    doc = sched.model_dump_json()
    caps = {"limit": 3, "channel_limit": 9, "scope": "web/u", "scope_limit": 9}
    assert await store.add(session, "n|w", session, sid, doc, due, **caps) == 1
    assert await store.add(session, "n|w", session, sid, doc, due, **caps) == 2  # same call
    assert await store.add(session, "x|zombie", session, "zombie", doc, due, **caps) == -1
    await redis.delete(K.lease(session))
    await redis.hset(K.session(session), "count", 0)  # its turn was committed
    return due


async def test_a_firing_is_delivered_once_whoever_fires_it(redis_factory) -> None:  # type: ignore[no-untyped-def]
    """Three workers' jobs and sweeps race for one firing: one delivers it (one entry in the
    session's stream) and moves the schedule on; the others find it moved."""
    loops = [AgentLoop(RedisBus(redis_factory()), ScriptedProvider([])) for _ in range(3)]
    redis = redis_factory()
    due = await _add(loops[0].schedules.store, redis, "web:once", every_s=3600)
    fired = await asyncio.gather(
        *(lp.schedules.fire(channel="web", sid="s1", due_ms=due) for lp in loops),
        *(lp.schedules.sweep({"web"}) for lp in loops),
    )
    assert sum(int(f) for f in fired) == 1
    [(_, fields)] = await redis.xrange(K.inbound("web:once"))
    msg = InboundMessage.model_validate_json(fields["payload"])
    assert msg.id == f"cron:s1:{due}"
    assert msg.input_role == "system"
    assert msg.sender_id == "cron"
    assert await redis.zscore(K.cron_due("web"), "s1") == due + 3_600_000
    assert await redis.zscore(K.queued("web"), "web:once") is not None  # the sweep's index
    for lp in loops:
        await lp.jobs.aclose()


async def test_a_schedule_of_a_session_never_stored_is_dropped_not_fired(redis) -> None:  # type: ignore[no-untyped-def]
    """The turn that added it was never committed (discarded, failed): its firing must
    not create a session (under a scope of its own that others would share). While the
    first turn still runs (its lease is held), the firing waits instead."""
    loop = AgentLoop(RedisBus(redis), ScriptedProvider([]))
    store = loop.schedules.store
    due = await _add(store, redis, "web:orphan", every_s=3600)
    await redis.delete(K.session("web:orphan"))
    await redis.set(K.lease("web:orphan"), "n|w", px=10_000)
    assert not await loop.schedules.fire(channel="web", sid="s1", due_ms=due)
    later = int(await redis.zscore(K.cron_due("web"), "s1"))  # waits for the commit,
    assert later > due  # put off (it holds up none of the channel's other firings)
    assert not await loop.schedules.fire(channel="web", sid="s1", due_ms=due)  # (moved)
    assert await redis.hget(K.cron_defs("web"), "s1") is not None
    await redis.delete(K.lease("web:orphan"))
    await redis.zadd(K.cron_due("web"), {"s1": due}, xx=True)  # (its time came)
    assert not await loop.schedules.fire(channel="web", sid="s1", due_ms=due)
    assert await redis.hget(K.cron_defs("web"), "s1") is None
    assert await redis.zscore(K.cron_due("web"), "s1") is None
    assert not await redis.exists(K.inbound("web:orphan"))


async def test_a_worker_made_message_never_starts_a_session(redis, make_loop) -> None:  # type: ignore[no-untyped-def]
    """A firing (or a subagent's result) that reaches a session with nothing stored is
    answered ``session_not_active`` and stores nothing: no session with the scope
    ``web/sender:cron`` that every such session would share."""
    make_loop(ScriptedProvider(handler=CronModel({})))
    client = FrontendClient(redis)
    msg = InboundMessage(
        id="cron:x:1", channel="web", chat_id="gone", sender_id="cron", input_role="system",
        content="Scheduled: stretch",
    )  # fmt: skip
    await client.send(msg)
    got = await collect(client, "web", {"cron:x:1"}, timeout_s=10)
    [answer] = [e for e in got["cron:x:1"] if e.is_terminal]
    assert answer.code == "session_not_active"
    assert not await redis.exists(K.session("web:gone"))


async def test_only_firings_within_the_horizon_are_queued_as_jobs(redis) -> None:  # type: ignore[no-untyped-def]
    """A firing days ahead waits in Redis only (the sweep queues it when it comes within
    two minutes), so removing schedules leaves no job behind for long; each firing is
    queued once per worker however often the sweep sees it."""
    loop = AgentLoop(RedisBus(redis), ScriptedProvider([]))
    jobs = loop.jobs
    assert isinstance(jobs, LocalJobQueue)
    now = int(time.time() * 1000)
    await loop.schedules.enqueue("web", "far", now + 86_400_000)
    assert not jobs._running
    await loop.schedules.enqueue("web", "near", now + 60_000)
    await loop.schedules.enqueue("web", "near", now + 60_000)
    assert len(jobs._running) == 1
    await jobs.aclose()


class CronModel:
    """Adds a schedule when asked to, answers everything else."""

    def __init__(self, args: dict[str, Any]) -> None:
        self.args = args

    async def __call__(self, **kw: Any) -> LLMResponse:
        last = kw["messages"][-1]
        if last["role"] == "user" and last["content"] == "remind me":
            call = ToolCallRequest("c1", "cron", {"action": "add", **self.args})
            return LLMResponse(tool_calls=[call])
        return LLMResponse(content=f"re: {last['content']}")


async def test_a_schedule_fires_into_its_session_and_goes_with_it(redis, make_loop) -> None:  # type: ignore[no-untyped-def]
    """A turn adds a schedule; its firings arrive as system messages of that session and are
    answered there, each once; deleting the session removes the schedule."""
    model = CronModel({"every_seconds": 1, "message": "stretch"})
    make_loop(ScriptedProvider(handler=model), cron_min_every_s=1, followup_mode="queue")
    client = FrontendClient(redis)
    msg = InboundMessage(id="r1", channel="web", chat_id="cr", sender_id="u", content="remind me")
    await client.send(msg)
    got = await collect(client, "web", {"r1"}, timeout_s=10)
    tool_rows = [e for e in got["r1"] if e.is_terminal]
    assert tool_rows[0].type == "message"
    [sid] = [s for s in await redis.smembers(K.crons("web:cr"))]

    async def firings() -> list[str]:
        return sorted(
            {e.reply_to or "" for e in await channel_events(client, "web") if e.is_terminal}
            - {"r1"}
        )

    await until(lambda: _at_least(firings, 2), timeout_s=15)
    fired = await firings()
    assert all(f.startswith(f"cron:{sid}:") for f in fired)
    got = await collect(client, "web", set(fired), timeout_s=10)
    for f in fired:
        assert [e.type for e in got[f] if e.is_terminal] == ["message"]
        assert "stretch" in (got[f][-1].content or "")
    await client.delete("web:cr")
    await until(lambda: _gone(redis, sid), timeout_s=10)


async def _at_least(firings: Any, n: int) -> bool:
    return len(await firings()) >= n


async def _gone(redis: aioredis.Redis, sid: str) -> bool:
    return (
        await redis.hget(K.cron_defs("web"), sid) is None
        and await redis.zscore(K.cron_due("web"), sid) is None
        and not await redis.exists(K.crons("web:cr"))
    )


# --- three worker processes, then a restart (real redis-server) -------------------------


def _due_of(reply_to: str) -> int:
    return int(reply_to.rsplit(":", 1)[1])


@pytest.mark.real_redis
@pytest.mark.slow
async def test_three_workers_fire_each_firing_once_and_again_after_a_restart(
    real_redis, redis_server, spawn_workers
) -> None:  # type: ignore[no-untyped-def]
    env = {"AGENT_CRON_MIN_EVERY_S": "1", "AGENT_FOLLOWUP_MODE": "queue"}
    workers = spawn_workers(3, env=env)
    client = FrontendClient(real_redis)
    add = json.dumps({"action": "add", "every_seconds": 1, "message": "tick"})
    await client.send(_m("every", f"toolcall:cron{add}"))
    await collect(client, "web", {"every"}, timeout_s=30)
    # the workers are up now: an `at` 2 s ahead is not in the past when its turn runs (a
    # start of the workers slower than that got it refused, under load)
    at = datetime.fromtimestamp(time.time() + 2, UTC).isoformat()
    once = json.dumps({"action": "add", "at": at, "message": "once"})
    await client.send(_m("at", f"toolcall:cron{once}"))
    await collect(client, "web", {"at"}, timeout_s=30)

    async def fired(chat: str) -> list[str]:
        events = await channel_events(client, "web")
        return [
            e.reply_to or ""
            for e in events
            if e.is_terminal and e.session_key == f"web:{chat}" and e.reply_to != chat
        ]

    await until(lambda: _count(fired, "every", 2), timeout_s=30)
    await until(lambda: _count(fired, "at", 1), timeout_s=30)
    for w in workers:
        w.kill()
    assert len(await fired("at")) == 1  # the one-shot fired once, and is gone
    assert not await real_redis.exists(K.crons("web:at"))
    before = await fired("every")
    assert len(before) == len(set(before))  # each firing answered once
    [sid] = await real_redis.smembers(K.crons("web:every"))
    due = int(await real_redis.zscore(K.cron_due("web"), sid))
    # every worker down while more firings come due
    await until(lambda: time.time() * 1000 > due + 1_500, timeout_s=10)
    spawn_workers(1, env=env)
    await until(lambda: _count(fired, "every", len(before) + 2), timeout_s=30)
    after = await fired("every")
    assert len(after) == len(set(after))
    dues = sorted(_due_of(r) for r in after)
    assert due in dues  # the overdue firing was delivered once, late ...
    gaps = [b - a for a, b in itertools.pairwise(dues)]
    late = dues.index(due)
    assert gaps[late] >= 2_000  # ... and the one missed after it was skipped
    assert all(g == 1_000 for i, g in enumerate(gaps) if i != late)
    # operators: list and remove
    cli_env = {"AGENT_REDIS_URL": redis_server.url}
    listed = await asyncio.to_thread(run_cli, "cron", "list", "--json", env=cli_env)
    assert [row["id"] for row in json.loads(listed.stdout)] == [sid]
    removed = await asyncio.to_thread(run_cli, "cron", "remove", sid, env=cli_env)
    assert removed.returncode == 0, removed.stderr
    assert await real_redis.zscore(K.cron_due("web"), sid) is None
    assert not await real_redis.sismember(K.crons("web:every"), sid)


async def _count(fired: Any, chat: str, n: int) -> bool:
    return len(await fired(chat)) >= n


def _m(chat: str, text: str) -> InboundMessage:
    return InboundMessage(id=chat, channel="web", chat_id=chat, sender_id="u", content=text)


@pytest.mark.real_redis
async def test_a_full_redis_loses_no_firing(real_redis) -> None:  # type: ignore[no-untyped-def]
    """At ``maxmemory`` (noeviction) the firing's publish is refused: the schedule stays
    due as it was (a one-shot too), and fires once Redis has room again."""
    loop = AgentLoop(RedisBus(real_redis), ScriptedProvider([]))
    due = await _add(loop.schedules.store, real_redis, "web:full", every_s=3600)
    await real_redis.hset(K.cron_defs("web"), "s1", Schedule(
        id="s1", session="web:full", channel="web", chat_id="full", message="once",
        kind="at", at_ms=due, created_ms=0,
    ).model_dump_json())  # fmt: skip
    await real_redis.config_set("maxmemory", "1")
    try:
        with pytest.raises(ResponseError, match="maxmemory"):
            await loop.schedules.fire(channel="web", sid="s1", due_ms=due)
    finally:
        await real_redis.config_set("maxmemory", "0")
    assert await real_redis.zscore(K.cron_due("web"), "s1") == due
    assert await real_redis.hget(K.cron_defs("web"), "s1") is not None
    assert await loop.schedules.fire(channel="web", sid="s1", due_ms=due)
    assert await real_redis.hget(K.cron_defs("web"), "s1") is None  # a one-shot: done
    assert await real_redis.xlen(K.inbound("web:full")) == 1


async def test_a_provider_error_keeps_the_schedule_in_the_history_and_retry_goes_on(
    redis, make_loop
) -> None:  # type: ignore[no-untyped-def]
    """The model adds a schedule, then the provider fails: the tool exchange is kept (the
    schedule is in the history, once); the Retry (same id) goes on from it, adding none."""
    calls: list[list[dict[str, Any]]] = []

    async def model(**kw: Any) -> LLMResponse:
        messages = kw["messages"]
        calls.append(messages)
        if not any(m["role"] == "tool" for m in messages):
            args = {"action": "add", "every_seconds": 3600, "message": "water the plants"}
            return LLMResponse(tool_calls=[ToolCallRequest("c1", "cron", args)])
        if len(calls) == 2:
            from worker.agent.providers import ProviderError

            raise ProviderError("InternalServerError: scripted")
        return LLMResponse(content="scheduled")

    make_loop(ScriptedProvider(handler=model))
    client = FrontendClient(redis)
    msg = InboundMessage(id="w1", channel="web", chat_id="pe", sender_id="u", content="remind")
    first = await client.ask(msg, timeout_s=10)
    assert first.code == "provider_error"
    assert await redis.scard(K.crons("web:pe")) == 1
    again = await client.ask(msg, timeout_s=10)
    assert again.content == "scheduled"
    assert await redis.scard(K.crons("web:pe")) == 1
    stored = await loop_rows(redis, "web:pe")
    assert [r["role"] for r in stored] == ["user", "assistant", "tool", "assistant"]


async def loop_rows(redis: aioredis.Redis, key: str) -> list[dict[str, Any]]:
    from session_store import RedisSessionStore

    session = await RedisSessionStore(redis, K).load(key)
    assert session is not None
    return session.messages


async def test_a_discarded_turn_takes_its_schedule_with_it(redis, make_loop) -> None:  # type: ignore[no-untyped-def]
    release = asyncio.Event()
    holding = asyncio.Event()

    async def model(**kw: Any) -> LLMResponse:
        if not any(m["role"] == "tool" for m in kw["messages"]):
            args = {"action": "add", "every_seconds": 3600, "message": "x"}
            return LLMResponse(tool_calls=[ToolCallRequest("c1", "cron", args)])
        holding.set()
        await release.wait()
        return LLMResponse(content="done")

    make_loop(ScriptedProvider(handler=model))
    client = FrontendClient(redis)
    await client.send(
        InboundMessage(id="d1", channel="web", chat_id="dc", sender_id="u", content="go")
    )
    await asyncio.wait_for(holding.wait(), 10)
    assert await redis.scard(K.crons("web:dc")) == 1
    await client.discard("web:dc")
    got = await collect(client, "web", {"d1"}, timeout_s=10)
    assert [e.code for e in got["d1"] if e.is_terminal] == ["cancelled"]
    await until(lambda: _no_schedules(redis, "web:dc"), timeout_s=10)
    assert await redis.hlen(K.cron_defs("web")) == 0
    release.set()


async def test_a_discarded_turn_gives_back_the_schedule_it_removed(redis, make_loop) -> None:  # type: ignore[no-untyped-def]
    """The first turn adds a schedule; the second removes it and is discarded while its
    model answers: the turn never happened, so the schedule is back as it was (its next
    firing, its session's set, its scope's count). It used to stay removed, and the
    remove was not fenced by the turn's lease either."""
    release = asyncio.Event()
    holding = asyncio.Event()
    sid: list[str] = []

    async def model(**kw: Any) -> LLMResponse:
        last = kw["messages"][-1]
        if last["role"] == "user" and last["content"] == "add":
            args = {"action": "add", "every_seconds": 3600, "message": "x"}
            return LLMResponse(tool_calls=[ToolCallRequest("c1", "cron", args)])
        if last["role"] == "user" and last["content"] == "remove":
            args = {"action": "remove", "id": sid[0]}
            return LLMResponse(tool_calls=[ToolCallRequest("c2", "cron", args)])
        if last["role"] == "tool" and str(last["content"]).startswith("Removed"):
            holding.set()
            await release.wait()
        return LLMResponse(content="done")

    make_loop(ScriptedProvider(handler=model))
    client = FrontendClient(redis)
    msg = {"channel": "web", "chat_id": "rc", "sender_id": "u"}
    await client.send(InboundMessage(id="r1", content="add", **msg))
    await collect(client, "web", {"r1"}, timeout_s=10)
    sid.extend(await redis.smembers(K.crons("web:rc")))
    before = await redis.zscore(K.cron_due("web"), sid[0])
    defs = await redis.hget(K.cron_defs("web"), sid[0])
    counts = await redis.hgetall(K.cron_per_scope("web"))
    await client.send(InboundMessage(id="r2", content="remove", **msg))
    await asyncio.wait_for(holding.wait(), 10)
    assert await redis.scard(K.crons("web:rc")) == 0  # removed while the turn runs
    await client.discard("web:rc")
    got = await collect(client, "web", {"r2"}, timeout_s=10)
    assert [e.code for e in got["r2"] if e.is_terminal] == ["cancelled"]
    await until(lambda: _schedules_are(redis, "web:rc", 1), timeout_s=10)
    assert await redis.zscore(K.cron_due("web"), sid[0]) == before
    assert await redis.hget(K.cron_defs("web"), sid[0]) == defs
    assert await redis.hgetall(K.cron_per_scope("web")) == counts
    release.set()


async def test_a_removed_schedule_comes_back_with_the_firing_it_had_when_removed(
    redis, make_loop
) -> None:  # type: ignore[no-untyped-def]
    """A firing moves the schedule on just before the cut turn's remove: the remove takes
    the definition and next firing in its own step, so the discard puts back the next
    firing it removed. It used to read them first and restore the firing already
    delivered (fired again, caught only by the message id)."""
    release = asyncio.Event()
    holding = asyncio.Event()
    sid: list[str] = []

    async def model(**kw: Any) -> LLMResponse:
        last = kw["messages"][-1]
        if last["role"] == "user" and last["content"] == "add":
            args = {"action": "add", "every_seconds": 3600, "message": "x"}
            return LLMResponse(tool_calls=[ToolCallRequest("c1", "cron", args)])
        if last["role"] == "user" and last["content"] == "remove":
            args = {"action": "remove", "id": sid[0]}
            return LLMResponse(tool_calls=[ToolCallRequest("c2", "cron", args)])
        if last["role"] == "tool" and str(last["content"]).startswith("Removed"):
            holding.set()
            await release.wait()
        return LLMResponse(content="done")

    loop = make_loop(ScriptedProvider(handler=model))
    client = FrontendClient(redis)
    msg = {"channel": "web", "chat_id": "rf", "sender_id": "u"}
    await client.send(InboundMessage(id="f1", content="add", **msg))
    await collect(client, "web", {"f1"}, timeout_s=10)
    sid.extend(await redis.smembers(K.crons("web:rf")))
    later = int(await redis.zscore(K.cron_due("web"), sid[0])) + 3_600_000
    call = loop.bus.scripts.call

    async def fired_first(name: str, keys: Any, args: Any, **kw: Any) -> Any:
        if name == "cron_remove":  # a firing landed first: it moved the schedule on
            await redis.zadd(K.cron_due("web"), {sid[0]: later}, xx=True)
        return await call(name, keys, args, **kw)

    loop.bus.scripts.call = fired_first
    await client.send(InboundMessage(id="f2", content="remove", **msg))
    await asyncio.wait_for(holding.wait(), 10)
    await client.discard("web:rf")
    await collect(client, "web", {"f2"}, timeout_s=10)
    await until(lambda: _schedules_are(redis, "web:rf", 1), timeout_s=10)
    assert await redis.zscore(K.cron_due("web"), sid[0]) == later
    release.set()


async def _schedules_are(redis: aioredis.Redis, session: str, n: int) -> bool:
    return await redis.scard(K.crons(session)) == n


async def _no_schedules(redis: aioredis.Redis, session: str) -> bool:
    return await redis.scard(K.crons(session)) == 0


async def test_many_firings_due_together_are_all_queued_as_jobs(redis) -> None:  # type: ignore[no-untyped-def]
    loop = AgentLoop(RedisBus(redis), ScriptedProvider([]))
    jobs = loop.jobs
    assert isinstance(jobs, LocalJobQueue)
    due = int(time.time() * 1000) + 60_000
    await redis.zadd(K.cron_due("web"), {f"s{i}": due for i in range(100)})
    await loop.schedules.sweep({"web"})
    assert len(jobs._running) == 100
    await loop.schedules.sweep({"web"})
    assert len(jobs._running) == 100  # once per worker
    await jobs.aclose()


async def test_idle_retention_keeps_a_session_with_schedules(redis) -> None:  # type: ignore[no-untyped-def]
    from session_store import RedisSessionStore, Session

    store = RedisSessionStore(redis, K)
    for chat in ("plain", "sched"):
        session = Session(key=f"web:{chat}", scope="web/u")
        session.add_message("user", "hi")
        await store.save(session)
    await redis.sadd(K.crons("web:sched"), "s1")
    assert await store.prune_idle("web", older_than_ms=-1) == ["web:plain"]
    assert await store.load("web:sched") is not None


async def test_a_stop_that_drops_the_exchange_drops_its_schedule(redis, make_loop) -> None:  # type: ignore[no-untyped-def]
    """One model answer calls cron add and a slow tool; a stop lands during the slow one:
    the exchange is not kept (incomplete), so neither is the schedule it added."""
    slow_started = asyncio.Event()

    class Slow:
        name = "slow"
        description = "takes its time"
        parameters: dict[str, Any] = {"type": "object", "properties": {}}

        async def execute(self, ctx: Any) -> str:
            slow_started.set()
            await asyncio.Event().wait()
            return "never"

    async def model(**kw: Any) -> LLMResponse:
        args = {"action": "add", "every_seconds": 3600, "message": "x"}
        return LLMResponse(
            tool_calls=[ToolCallRequest("c1", "cron", args), ToolCallRequest("c2", "slow", {})]
        )

    from worker.agent.tools import default_registry

    tools = default_registry()
    tools.register(Slow())  # type: ignore[arg-type]
    loop = AgentLoop(
        RedisBus(redis), ScriptedProvider(handler=model), tools=tools,
        config=LoopConfig(read_block_ms=50),
    )  # fmt: skip
    task = asyncio.create_task(loop.run())
    client = FrontendClient(redis)
    await client.send(
        InboundMessage(id="s1", channel="web", chat_id="sc", sender_id="u", content="go")
    )
    await asyncio.wait_for(slow_started.wait(), 10)
    assert await redis.scard(K.crons("web:sc")) == 1
    await client.stop("web:sc")
    got = await collect(client, "web", {"s1"}, timeout_s=10)
    assert [e.code for e in got["s1"] if e.is_terminal] == ["cancelled"]
    await until(lambda: _no_schedules(redis, "web:sc"), timeout_s=10)
    loop.stop()
    await asyncio.wait_for(task, 10)


async def test_a_stream_that_takes_no_entry_skips_its_own_schedule_only(redis) -> None:  # type: ignore[no-untyped-def]
    """A frontend's junk in one session's stream (the maximal id: no XADD '*' succeeds)
    moves that schedule on without a message, as another type at the name does; the
    channel's other schedules are fired in the same sweep."""
    loop = AgentLoop(RedisBus(redis), ScriptedProvider([]))
    store = loop.schedules.store
    junk = await _add(store, redis, "web:junk", every_s=3600, sid="s1")
    await _add(store, redis, "web:fine", every_s=3600, sid="s2")
    top = "18446744073709551615-18446744073709551615"
    await redis.xadd(K.inbound("web:junk"), {"payload": "x"}, id=top)
    assert await loop.schedules.sweep({"web"}) == 1
    assert len(await redis.xrange(K.inbound("web:fine"))) == 1  # fired
    assert await redis.zscore(K.cron_due("web"), "s1") == junk + 3_600_000  # moved on
    await loop.jobs.aclose()


async def test_an_unreadable_schedule_purged_frees_its_sessions_place(redis) -> None:  # type: ignore[no-untyped-def]
    """A definition that cannot be read is purged by whoever meets it (its session is
    not known then, so the id stays in the session's set). The session's next add at its
    limit drops such ids instead of refusing: the purged schedule held a place for ever."""
    from bus_redis import RedisBus
    from bus_redis.schedules import ScheduleStore

    store = ScheduleStore(RedisBus(redis))
    await redis.set(K.lease("web:u"), "n|w", px=60_000)

    async def add(sid: str) -> int:
        return await store.add("web:u", "n|w", "web:u", sid, "{}", 10**13, limit=2,
                               channel_limit=10, scope="web/u", scope_limit=10)  # fmt: skip

    assert [await add("a"), await add("b"), await add("c")] == [1, 1, 0]
    await store.purge("web", "a")  # as ``fire`` does with an unreadable definition
    assert await add("c") == 1
    assert await redis.smembers(K.crons("web:u")) == {"b", "c"}
    assert await add("d") == 0  # the limit still holds


def test_a_put_off_firing_names_the_schedules_own_time() -> None:
    """A firing put off (moved later in the due index while a private session held its
    chat) names the time it was due: an `every` its last step at or before it, a cron
    its last time at or before it (in its zone), an `at` its time; a firing on time names
    its own time, and an `every` stored before anchors were kept names when it fired."""
    base = {"id": "s", "session": "web:c", "channel": "web", "chat_id": "c", "message": "m"}
    hour = int(datetime(2026, 3, 1, 9, 0, tzinfo=UTC).timestamp() * 1000)
    at = Schedule(kind="at", at_ms=hour, created_ms=0, **base)
    assert at.named_due(hour + 10_000) == hour
    every = Schedule(kind="every", every_s=60, anchor_ms=hour, created_ms=0, **base)
    assert every.named_due(hour + 60_000) == hour + 60_000  # on time
    assert every.named_due(hour + 130_000) == hour + 120_000  # put off 10 s
    legacy = Schedule(kind="every", every_s=60, created_ms=0, **base)
    assert legacy.named_due(hour + 130_000) == hour + 130_000
    cron = Schedule(kind="cron", cron_expr="0 * * * *", tz="Europe/Berlin", created_ms=0, **base)
    assert cron.named_due(hour) == hour  # on time
    assert cron.named_due(hour + 10_000) == hour
    assert cron.named_due(hour + 3_599_999) == hour
