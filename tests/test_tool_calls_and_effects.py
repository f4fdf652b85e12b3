"""Tool calls as models make them, and the outside effects of calls a turn does not keep
(a second reader's tests): arguments JSON Schema allows (nulls, whole floats, extra
keys), a schedule of a turn that will never run again, a firing whose notification is
refused, and a cut round's subagent when providers reuse call ids."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
import redis.asyncio as aioredis
from helpers import ScriptedProvider
from replies import collect, until

from bus_redis import FrontendClient, InboundMessage, Keys, RedisBus
from session_store import Session
from worker import AgentLoop, LoopConfig
from worker.agent.providers import LLMResponse, ToolCallRequest
from worker.agent.tools import ToolContext, default_registry
from worker.jobs.schedule_rules import Schedule

K = Keys()


def _m(chat: str, text: str, id_: str) -> InboundMessage:
    return InboundMessage(id=id_, channel="web", chat_id=chat, sender_id="u", content=text)


async def _no_emit(_text: str) -> None:
    return None


# --- 1. the argument checker refuses what the tools themselves accept -------------------


class _CronOnce:
    def __init__(self, args: dict[str, Any]) -> None:
        self.args = args

    async def __call__(self, **kw: Any) -> LLMResponse:
        last = kw["messages"][-1]
        if last["role"] == "user" and last["content"] == "remind me":
            return LLMResponse(
                tool_calls=[ToolCallRequest("c1", "cron", {"action": "add", **self.args})]
            )
        return LLMResponse(content="ok")


@pytest.mark.parametrize(
    "args",
    [
        # OpenAI strict mode / many models: every property present, the unused ones null
        {"message": "stretch", "every_seconds": 3600, "at": None, "cron_expr": None, "tz": None},
        # a whole number sent as a JSON float (parse_schedule's _every accepts it on purpose)
        {"message": "stretch", "every_seconds": 3600.0},
        # a key the schema does not name (it does not say additionalProperties: false)
        {"message": "stretch", "every_seconds": 3600, "kind": "every"},
    ],
    ids=["nulls-for-unused", "whole-float", "extra-key"],
)
async def test_cron_calls_parse_schedule_accepts_are_not_refused_by_the_checker(
    redis, make_loop, args: dict[str, Any]
) -> None:  # type: ignore[no-untyped-def]
    make_loop(ScriptedProvider(handler=_CronOnce(args)), followup_mode="queue")
    client = FrontendClient(redis)
    await client.send(_m("cr", "remind me", "r1"))
    await collect(client, "web", {"r1"}, timeout_s=10)
    stored = json.loads(await redis.hget(K.session("web:cr"), "m:2") or "{}")
    assert stored.get("role") == "tool"
    assert not str(stored.get("content")).startswith("Error"), stored.get("content")
    assert await redis.scard(K.crons("web:cr")) == 1


@pytest.mark.parametrize(
    ("name", "args"),
    [
        ("read_session", {"session_key": None, "limit": 5}),  # optional given as null
        ("read_session", {"limit": 5.0}),  # integer sent as a float
    ],
)
async def test_read_session_with_null_or_whole_float_arguments_still_reads(
    redis: aioredis.Redis, name: str, args: dict[str, Any]
) -> None:
    """Before the checker, ``session_key: null`` read the current session (``not
    session_key``); JSON Schema's ``integer`` is any number with a zero fraction."""
    loop = AgentLoop(RedisBus(redis), ScriptedProvider(), config=LoopConfig())
    session = Session(key="web:here", scope="web/sender:u")
    session.add_message("user", "hello there")
    ctx = ToolContext(session, loop.sessions, emit=_no_emit)
    out = await default_registry().execute(name, args, ctx)
    assert not out.startswith("Error"), out
    assert json.loads(out)[0]["content"] == "hello there"


# --- 2. the journal of a dead-lettered first turn keeps its schedule alive ---------------


async def test_a_dead_lettered_first_turns_schedule_is_dropped_not_kept_by_its_journal(
    redis, make_loop
) -> None:  # type: ignore[no-untyped-def]
    """A first turn adds a schedule, then fails on every delivery and is dead-lettered:
    nothing is stored and nothing will run it again. cron_fire.lua now answers -3 ("not
    now") while the session's tool journal exists, and a dead letter never drops the
    journal (TTL one day): the schedule of a turn the user was told failed is kept, and
    fires into the chat as soon as any later turn stores the session (ARCHITECTURE: a
    schedule whose turn was not committed is dropped at its first firing)."""

    async def handler(**kw: Any) -> LLMResponse:
        last = kw["messages"][-1]
        if last["role"] == "user" and last["content"] == "remind me":
            return LLMResponse(tool_calls=[ToolCallRequest(
                "c1", "cron", {"action": "add", "every_seconds": 3600, "message": "stretch"}
            )])  # fmt: skip
        if last["role"] == "tool":
            raise RuntimeError("poison")  # this turn never succeeds
        return LLMResponse(content="ok")

    make_loop(ScriptedProvider(handler=handler), followup_mode="queue", max_deliveries=1)
    client = FrontendClient(redis)
    await client.send(_m("dl", "remind me", "d1"))
    got = await collect(client, "web", {"d1"}, timeout_s=15)
    assert [e.code for e in got["d1"] if e.is_terminal] == ["dead_lettered"]
    assert not await redis.exists(K.session("web:dl"))  # never stored
    # the dead letter removes it (the lost attempt's journal names the call); a firing
    # of a never-stored session drops it all the same should one be left
    assert not await redis.smembers(K.crons("web:dl"))
    assert not await redis.hgetall(K.cron_defs("web")), (
        "the schedule of a dead-lettered, never-stored turn is kept (journal: "
        f"{await redis.hgetall(K.journal('web:dl'))!r})"
    )


# --- 3. cron_fire: the ready queue refuses after the message was added -------------------


async def test_a_firing_is_not_added_twice_when_the_ready_queue_refuses(
    redis: aioredis.Redis,
) -> None:
    """The frontend may XADD its channel's ready queue with an explicit id; at the maximal
    id the queue takes no entry. cron_fire.lua adds the message to the session's stream
    first and then fails on the ready queue with redis.call: a script error keeps the
    writes before it, the due index is not moved, and every later sweep adds the same
    firing again (the sweep now logs and carries on)."""
    loop = AgentLoop(RedisBus(redis), ScriptedProvider([]))
    store = loop.schedules.store
    session = "web:rq"
    sched = Schedule(id="s1", session=session, channel="web", chat_id="rq", message="tick",
                     kind="every", every_s=3600, created_ms=0)  # fmt: skip
    await redis.set(K.lease(session), "n|w", px=10_000)
    due = int(time.time() * 1000) - 1
    caps = {"limit": 3, "channel_limit": 9, "scope": "web/u", "scope_limit": 9}
    assert await store.add(session, "n|w", session, "s1", sched.model_dump_json(), due, **caps) == 1
    await redis.delete(K.lease(session))
    await redis.hset(K.session(session), "count", 0)
    top = "18446744073709551615-18446744073709551615"
    await redis.xadd(K.ready("web"), {"session": "x"}, id=top)
    for _ in range(3):  # (a channel's failure is logged by the sweep, never raised)
        await loop.schedules.sweep({"web"})
    entries = await redis.xrange(K.inbound(session))
    await loop.jobs.aclose()
    assert len(entries) <= 1, f"one firing was added {len(entries)} times"


# --- 4. spawn undo keyed by a call id a provider reuses across rounds --------------------


async def test_an_interrupt_takes_the_dropped_rounds_subagent_even_when_ids_repeat(
    redis, make_loop
) -> None:  # type: ignore[no-untyped-def]
    """A provider that numbers tool calls per response (``call_0`` every round; the
    runner's _exchanges already allows for it). Round one spawns (kept); round two spawns
    again and reads a session (held), then an interrupt drops round two. ``_undo`` skips
    every call whose model id is in the kept rows, so round two's subagent survives and
    its result answers a call the history does not hold."""
    reading, release = asyncio.Event(), asyncio.Event()

    async def handler(**kw: Any) -> LLMResponse:
        messages = kw["messages"]
        last = messages[-1]
        if last["role"] == "user" and str(last["content"]).startswith("Task"):
            await release.wait()  # subagents run until the test ends
            return LLMResponse(content="found")
        if last["role"] == "user" and last["content"] == "go":
            return LLMResponse(tool_calls=[
                ToolCallRequest("call_0", "spawn", {"task": "first", "label": "one"})
            ])  # fmt: skip
        if last["role"] == "tool" and sum(m["role"] == "tool" for m in messages) == 1:
            return LLMResponse(tool_calls=[
                ToolCallRequest("call_0", "spawn", {"task": "second", "label": "two"}),
                ToolCallRequest("call_1", "read_session", {"session_key": "web:elsewhere"}),
            ])  # fmt: skip
        return LLMResponse(content="ok")

    loop = make_loop(ScriptedProvider(handler=handler), subagents_per_session=4)
    read = loop.rt.sessions.read_session

    async def held_read(*args: Any, **kw: Any) -> Any:
        reading.set()
        await asyncio.Event().wait()
        return await read(*args, **kw)

    loop.rt.sessions.read_session = held_read
    client = FrontendClient(redis)
    await client.send(_m("ids", "go", "g1"))
    await asyncio.wait_for(reading.wait(), 10)
    await client.send_entry(
        _m("ids", "never mind", "g2").model_copy(update={"followup": "interrupt"})
    )
    got = await collect(client, "web", {"g1", "g2"}, timeout_s=10)
    assert [e.code for e in got["g1"] if e.is_terminal] == ["cancelled"]
    try:
        labels = sorted(
            json.loads(v)["label"] for v in (await redis.hgetall(K.spawned("web:ids"))).values()
        )
        assert labels == ["one"], f"registered after the interrupt: {labels}"
    finally:
        release.set()
        await until(lambda: not loop.subagents.running, timeout_s=10)
