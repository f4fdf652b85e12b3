"""A hostile review of the background work: schedules (the ``cron`` tool, its firing and
sweep), subagents, consolidation, the idle prune and the maintenance ticks. Each test
names the defect it shows and the behaviour that is right; each failed on 0337dab (the
unified session's schedules were lost to a `new` and to the idle prune)."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis.asyncio as aioredis
from helpers import ScriptedProvider
from replies import collect, until, wait_until_async
from test_tool_calls_and_effects import _CronOnce

from bus_redis import FrontendClient, InboundMessage, Keys, RedisBus
from session_store import RedisSessionStore
from worker import AgentLoop

K = Keys()
UNIFIED = "unified:default"


def _msg(chat: str, text: str, mid: str) -> InboundMessage:
    return InboundMessage(id=mid, channel="web", sender_id="u", chat_id=chat, content=text)


async def _one_schedule(redis: aioredis.Redis, session: str) -> str:
    [sid] = list(await redis.smembers(K.crons(session)))
    return str(sid)


async def _firing_outcome(redis: aioredis.Redis, sid: str, due: int) -> str:
    """'fired' once the firing was published (moved on, or a one-shot gone with a firing
    published), 'dropped' once the schedule is gone without one, '' meanwhile."""
    firing, published = f"cron:{sid}:{due}", False
    for chat in ("yr", "b"):
        for stream in (K.out(f"web:{chat}"), K.inbound(f"web:{chat}")):
            for _, fields in await redis.xrange(stream):
                published = published or any(firing in v for v in fields.values())
    if published:
        return "fired"
    if await redis.hget(K.cron_defs("web"), sid) is None:
        return "dropped"
    return ""


async def _fired(redis: aioredis.Redis, sid: str, due: int) -> None:
    """The firing is published (its entry or its answer is seen; between the two, the
    entry taken and the answer not written yet, neither is: polled until one is)."""

    async def fired() -> bool:
        return await _firing_outcome(redis, sid, due) == "fired"

    await until(fired, timeout_s=10)


async def test_unified_idle_prune_keeps_a_chat_with_schedules_and_its_firing_lands(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """Defect: in unified mode the idle prune (``RedisSessionStore.prune_idle``) asks
    whether ``crons(unified:default)`` exists, but schedules live in each chat's own set
    (``crons(web:<chat>)``): the shared session is deleted although a chat holds a
    schedule (an ``at`` months ahead), and ``cron_fire.lua`` then drops that schedule at
    its time as one "never stored". README: a session with schedules is not deleted by
    AGENT_SESSION_TTL_S. Right: the unified session is kept while a chat it serves has
    schedules, and the schedule fires into its chat when due."""
    at = (datetime.now(UTC) + timedelta(days=120)).isoformat(timespec="seconds")
    loop = make_loop(
        ScriptedProvider(handler=_CronOnce({"at": at, "message": "renew"})),
        unified_session=True,
    )  # fmt: skip
    client = FrontendClient(redis)
    await client.send(_msg("yr", "remind me", "r1"))
    await collect(client, "web", {"r1"}, timeout_s=10)
    sid = await _one_schedule(redis, "web:yr")
    assert await redis.exists(K.session(UNIFIED))

    # the sweeping worker's prune after AGENT_SESSION_TTL_S of quiet
    assert await redis.zadd(K.sessions_index("unified"), {UNIFIED: 1}, xx=True, ch=True) == 1
    await loop.maintenance.prune_idle()
    assert await redis.exists(K.session(UNIFIED)), (
        "the unified session was pruned although a chat holds a schedule"
    )
    gone = await RedisSessionStore(redis, K).prune_idle(  # (as `sessions prune` does)
        "unified", older_than_ms=-1, schedules_of=["web"]
    )
    assert gone == [], "the unified session was pruned although a chat holds a schedule"

    # its time comes (four months on): it fires into web:yr, it is not dropped
    due = int(time.time() * 1000) - 1
    await redis.zadd(K.cron_due("web"), {sid: due}, xx=True)
    await loop.schedules.sweep({"web"})
    await _fired(redis, sid, due)


async def test_unified_new_in_one_chat_does_not_silently_drop_another_chats_schedule(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """Defect: in unified mode a ``new`` (``/new``) in chat A folds and deletes the shared
    ``unified:default`` hash; chat B's recurring schedule stays listed in B's set, but
    ``cron_fire.lua`` keys its "never stored" check on the effective key's hash, so the
    next firing of B's schedule, if it comes before anyone writes again, is dropped for
    good (nothing published, definition deleted). Whether B keeps its schedule depends on
    whether some message happened to land first. Right: the schedule of a chat that was
    stored and was not deleted (B's set still holds it, ``cron list`` in B shows it)
    fires into chat B when due (unified mode is single-owner: a firing is not refused for
    its scope), or is removed by the ``new`` with B told so; never silently lost at a
    firing."""
    model = _CronOnce({"every_seconds": 3600, "message": "stretch"})
    loop = make_loop(ScriptedProvider(handler=model), unified_session=True)
    client = FrontendClient(redis)
    await client.send(_msg("b", "remind me", "b1"))
    await collect(client, "web", {"b1"}, timeout_s=10)
    sid = await _one_schedule(redis, "web:b")
    await client.send(_msg("a", "hello", "a1"))
    await collect(client, "web", {"a1"}, timeout_s=10)

    await client.new("web:a")  # chat A starts a new (shared) conversation

    async def marker_reached() -> bool:
        return not await redis.xlen(K.inbound("web:a"))

    assert await wait_until_async(marker_reached, timeout_s=10)
    if not await redis.sismember(K.crons("web:b"), sid):
        return  # removed with the `new` (and no longer listed in B): a decision, not a loss

    due = int(time.time() * 1000) - 1  # B's hourly firing comes due
    await redis.zadd(K.cron_due("web"), {sid: due}, xx=True)
    await loop.schedules.sweep({"web"})
    await _fired(redis, sid, due)
    firing = f"cron:{sid}:{due}"
    events = (await collect(client, "web", {firing}, timeout_s=10))[firing]
    answer = [e for e in events if e.is_terminal][-1]
    assert (answer.type, answer.code) == ("message", None), "the firing was not run"


# --- found by this stop's own reading of the helper's suspicions ------------------------


async def test_a_tool_whose_fenced_write_finds_the_lease_lost_ends_the_turn(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis,
) -> None:
    """The cron and spawn tools raise ``TurnAbortedError`` when their fenced write finds
    the turn's lease taken (another holder since), but ``ToolRegistry.execute`` turned
    every exception into an error string for the model: the turn went on, with a model
    call more for a turn that can write nothing. Right: the abort leaves the registry."""
    from session_store import Session
    from worker.agent.tools.base import ToolContext, ToolRegistry, schema
    from worker.runtime.outcomes import TurnAbortedError

    class Fenced:
        name, description, parameters = "fenced", "a fenced write", schema({})

        async def execute(self, ctx: ToolContext) -> str:
            raise TurnAbortedError("lease_lost")

    loop = AgentLoop(RedisBus(redis), ScriptedProvider([]))

    async def quiet(*_: Any, **__: Any) -> None:
        return None

    ctx = ToolContext(Session(key="web:lost"), loop.sessions, emit=quiet)
    try:
        out = await ToolRegistry([Fenced()]).execute("fenced", {}, ctx)
    except TurnAbortedError:
        return
    raise AssertionError(f"the turn went on after its lease was lost: {out!r}")


def test_an_at_far_in_the_past_with_an_offset_says_why() -> None:
    """An ``at`` of year 1 with a positive offset made the "in the past" message raise
    ``ValueError`` itself (its time shown in UTC is year 0): the model got "cron failed:
    ValueError" without the reason. Right: it is told the time is in the past."""
    from worker.jobs.schedule_rules import ScheduleError, parse_schedule

    args = {"at": "0001-01-01T00:00:00+00:01", "message": "x"}
    with pytest.raises(ScheduleError, match="in the past"):
        parse_schedule(args, sid="s", session="web:c", chat_id="c", min_every_s=60, now=0)
