"""Firings that cannot be delivered now are put off, not lost and not in the way: a
one-shot schedule of a stored chat whose key holds a private session when it comes due
(it was delivered and answered ``session_not_active``, the schedule gone with it), and
overdue firings that cannot be delivered holding up the rest of their channel's (the
sweep takes the most overdue first, and a firing answered "not now" kept its place at
the head of the due index). Each test failed on the code before the change."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis.asyncio as aioredis
from helpers import ScriptedProvider
from replies import collect, until
from test_private_beside_durable import _durable, _private, scheduling

from bus_redis import FrontendClient, Keys, RedisBus
from worker import AgentLoop
from worker.agent.providers import LLMResponse, ToolCallRequest
from worker.jobs.schedule_rules import Schedule
from worker.jobs.schedules import SWEEP_BATCH

K = Keys()


@pytest.mark.parametrize("unified", [False, True])
async def test_a_one_shot_firing_waits_out_the_private_session_on_its_key(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop, unified: bool
) -> None:
    """A one-shot ``at`` schedule of ``web:os`` comes due while a private session is open
    on ``web:os``. Before: the firing was delivered, refused (it must never run in the
    private conversation) and the schedule was gone: the reminder was lost. Now it is
    put off while the private session is open, and runs in the stored chat (with the
    chat's history, none of the private one's) once the private session ended. Unified
    mode (a second reading: the put-off looked for the private session's owner record
    under the shared key, where a chat's private session never has one)."""
    calls: list[str] = []
    at = (datetime.now(UTC) + timedelta(hours=1)).isoformat(timespec="seconds")

    async def model(**kw: Any) -> LLMResponse:
        calls.append(json.dumps(kw["messages"]))
        last = kw["messages"][-1]
        if last["role"] == "user" and last["content"] == "remind me about TEA-DURABLE":
            args = {"action": "add", "at": at, "message": "ONE-SHOT-NOW"}
            return LLMResponse(tool_calls=[ToolCallRequest("c1", "cron", args)])
        return LLMResponse(content="ok")

    loop = make_loop(
        ScriptedProvider(handler=model), followup_mode="queue", unified_session=unified
    )
    client = FrontendClient(redis)
    ask = _durable("os", "remind me about TEA-DURABLE", "r1", scope="u")
    assert (await client.ask(ask, timeout_s=10)).type == "message"
    [sid] = list(await redis.smembers(K.crons("web:os")))
    key, opened = await client.open_transient("web", "os", session_key="web:os", scope="u")
    await collect(client, "web", {opened}, timeout_s=10)
    private = _private(key, "PRIVATE-SECRET-5", "p1", scope="u")
    assert (await client.ask(private, timeout_s=10)).type == "message"

    due = int(time.time() * 1000) - 1000  # its time came
    assert await redis.zadd(K.cron_due("web"), {sid: due}, xx=True, ch=True) == 1
    assert not await loop.schedules.fire(channel="web", sid=sid, due_ms=due)
    assert await redis.hget(K.cron_defs("web"), sid) is not None, "the one-shot was lost"

    assert await client.discard(key) >= 1  # the private session ends

    async def ended() -> bool:
        return not await redis.exists(K.owner(key))

    await until(ended, timeout_s=10)
    await fired_late(redis, loop, client, sid)
    [ran] = [c for c in calls if "Scheduled (once" in c]
    assert "TEA-DURABLE" in ran, "the firing ran without the stored chat's history"
    assert "PRIVATE-SECRET-5" not in ran, "the firing ran in the private conversation"
    assert await redis.hget(K.cron_defs("web"), sid) is None  # a one-shot: done now


async def fired_late(
    redis: aioredis.Redis, loop: AgentLoop, client: FrontendClient, sid: str
) -> None:
    """Schedule ``sid``'s put-off time came: it fires, and its turn is answered."""
    later = int(time.time() * 1000) - 1
    assert await redis.zadd(K.cron_due("web"), {sid: later}, xx=True, ch=True) == 1
    assert await loop.schedules.fire(channel="web", sid=sid, due_ms=later)
    firing = f"cron:{sid}:{later}"
    reply = [e for e in (await collect(client, "web", {firing}, timeout_s=10))[firing]
             if e.is_terminal][-1]  # fmt: skip
    assert (reply.type, reply.code) == ("message", None)


async def stored_every(
    redis: aioredis.Redis, session: str, sid: str, due: int, *, anchored: bool = False
) -> None:
    """An hourly ``every`` schedule of stored session ``session`` due at ``due`` (with
    ``anchored``, naming it its first firing, as the cron tool's add does)."""
    store = AgentLoop(RedisBus(redis), ScriptedProvider([])).schedules.store
    doc = Schedule(
        id=sid, session=session, channel="web", chat_id=session.split(":", 1)[1],
        message="tick", kind="every", every_s=3600, created_ms=0,
        anchor_ms=due if anchored else None,
    ).model_dump_json()  # fmt: skip
    await redis.set(K.lease(session), "n|w", px=10_000)
    caps = {"limit": 3, "channel_limit": 99, "scope": f"web/{sid}", "scope_limit": 9}
    assert await store.add(session, "n|w", session, sid, doc, due, **caps) == 1
    await redis.delete(K.lease(session))
    await redis.hset(K.session(session), "count", 0)  # its turn was committed


async def test_firings_put_off_hold_up_none_of_their_channels_others(redis) -> None:  # type: ignore[no-untyped-def]
    """More than ``SWEEP_BATCH`` overdue firings of ``web`` cannot be delivered now (the
    first turn of each one's session, which added it, still runs), and they are the most
    overdue. Before:
    each sweep took the same ones again, answered "not now", and the channel's other
    overdue firing never fired. Now a firing put off moves in the due index, so the next
    sweep reaches the other one."""
    loop = AgentLoop(RedisBus(redis), ScriptedProvider([]))
    now = int(time.time() * 1000)

    for i in range(SWEEP_BATCH + 1):
        await stored_every(redis, f"web:held{i}", f"h{i}", now - 100_000 + i)
        await redis.delete(K.session(f"web:held{i}"))  # its first turn still runs
        await redis.set(K.lease(f"web:held{i}"), "n|w", px=60_000)
    await stored_every(redis, "web:free", "free", now - 1_000)

    delivered = 0
    for _ in range(3):  # (the first sweep meets the put-off ones)
        delivered += await loop.schedules.sweep({"web"})
    assert delivered == 1, "the channel's other overdue firing never fired"
    assert await redis.xlen(K.inbound("web:free")) == 1
    for i in range(SWEEP_BATCH + 1):
        assert not await redis.exists(K.inbound(f"web:held{i}"))
    await loop.jobs.aclose()


async def test_an_every_schedule_the_tool_adds_keeps_step_with_its_first_firing(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """The cron tool's `every` schedule names its first firing (``anchor_ms``), which its
    later times keep step with, whenever one of them is delivered (a second reading: a
    firing put off moved every one after it)."""

    async def model(**kw: Any) -> LLMResponse:
        last = kw["messages"][-1]
        if last["role"] == "user" and last["content"] == "every hour":
            args = {"action": "add", "every_seconds": 3600, "message": "stretch"}
            return LLMResponse(tool_calls=[ToolCallRequest("c1", "cron", args)])
        return LLMResponse(content="ok")

    make_loop(ScriptedProvider(handler=model))
    client = FrontendClient(redis)
    assert (await client.ask(_durable("ev", "every hour", "e1"), timeout_s=10)).type == "message"
    [sid] = list(await redis.smembers(K.crons("web:ev")))
    doc = Schedule.model_validate_json(await redis.hget(K.cron_defs("web"), sid))
    first = int(await redis.zscore(K.cron_due("web"), sid))
    assert doc.anchor_ms == first
    put_off = first + 10_000  # delivered 10 s late: the next is still an hour after the first
    assert doc.next_due(put_off, put_off) == first + 3_600_000


@pytest.mark.parametrize("backlog", [0, 17])
async def test_a_firing_waits_out_a_private_opening_not_handled_yet(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop, backlog: int
) -> None:
    """An hourly schedule of the stored chat ``web:ow`` comes due in the moment between a
    private opening's publish on ``web:ow`` and its handling (no owner record yet).
    Before: the firing was delivered behind the opening, refused there (it must never run
    in the private conversation) and lost. Now it is put off while the opening waits in
    the stream, and runs in the stored chat once the private session ended. With a queue
    longer than the script looks at (``backlog``: 17 plain messages before the opening)
    it is put off too."""
    calls: list[str] = []
    model = scheduling(calls, "tick hourly about TEA-DURABLE", "HOURLY")
    loop = make_loop(model, followup_mode="queue")
    client = FrontendClient(redis)
    ask = _durable("ow", "tick hourly about TEA-DURABLE", "r1", scope="u")
    assert (await client.ask(ask, timeout_s=10)).type == "message"
    [sid] = list(await redis.smembers(K.crons("web:ow")))

    # published, not yet handled: in the stream, its notification not read yet
    stream = K.inbound("web:ow")
    for i in range(backlog):
        await redis.xadd(stream, {"payload": _durable("ow", f"q{i}", f"q{i}").model_dump_json()})
    opening = {"op": "open_transient", "id": "o1", "channel": "web", "chat_id": "ow",
               "session_key_override": "web:ow", "scope": "u"}  # fmt: skip
    await redis.xadd(stream, {"payload": json.dumps(opening)})
    due = int(time.time() * 1000) - 1000
    assert await redis.zadd(K.cron_due("web"), {sid: due}, xx=True, ch=True) == 1
    assert not await loop.schedules.fire(channel="web", sid=sid, due_ms=due)
    assert await redis.xlen(stream) == backlog + 1, "the firing followed the opening"
    assert float(await redis.zscore(K.cron_due("web"), sid) or 0) > due  # put off

    await redis.xadd(K.ready("web"), {"session": "web:ow"})  # the opening is handled now
    await collect(client, "web", {"o1"}, timeout_s=10)
    assert await client.discard("web:ow") >= 1  # the private session ends

    async def ended() -> bool:
        return not await redis.exists(K.owner("web:ow")) and not await redis.xlen(stream)

    await until(ended, timeout_s=10)
    await fired_late(redis, loop, client, sid)
    [ran] = [c for c in calls if "HOURLY" in c and "Scheduled (" in c]
    assert "TEA-DURABLE" in ran, "the firing ran without the stored chat's history"


async def test_a_firing_behind_a_short_queue_of_messages_is_delivered(redis) -> None:  # type: ignore[no-untyped-def]
    """The look for a waiting opening reads a few entries: plain messages queued in the
    stream do not put a firing off (it is queued behind them, as before)."""
    loop = AgentLoop(RedisBus(redis), ScriptedProvider([]))
    now = int(time.time() * 1000)
    await stored_every(redis, "web:busy", "b1", now - 1_000)
    for i in range(3):
        await redis.xadd(
            K.inbound("web:busy"), {"payload": _durable("busy", "hi", f"m{i}").model_dump_json()}
        )
    assert await loop.schedules.fire(channel="web", sid="b1", due_ms=now - 1_000)
    assert await redis.xlen(K.inbound("web:busy")) == 4
    await loop.jobs.aclose()
