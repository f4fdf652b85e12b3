"""Hostile-frontend flood audit, round 8 (a helper's, stop 51): what one channel (or one
gateway user) writes must not make a worker, script or cache do work or hold memory in
proportion to it. Five tests failed before stop 51's fixes; the interrupt tests measure
what a check brings into the worker (``interrupts.lua`` walks the stream inside Redis
now, so they read its reply: the payloads after interrupt markers).

Each test floods from one channel and asserts a bound (entries or bytes read, entries
held in a Python table) on behaviour, never on time. On fakeredis and a real
redis-server (the ``redis_factory`` fixture) where Redis is involved."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from helpers import ScriptedProvider
from replies import collect
from test_interrupt_scope import Model

from bus_redis import ControlMessage, FrontendClient, InboundMessage, RedisBus
from worker import AgentLoop, LoopConfig
from worker.agent.providers import LLMResponse
from worker.runtime.interrupts import SCAN as INTERRUPT_SCAN

SCAN_BYTES = 1_048_576  # the byte budget of every other look into a stream (_common.lua)
PAYLOAD = 262_144  # AGENT_MAX_PAYLOAD_BYTES: an operator caps proto-max-bulk-len near it


@dataclass
class Working:
    loop: AgentLoop
    model: Model
    client: FrontendClient
    read: list[tuple[int, int]]  # per interrupt read: (entries, bytes) the XRANGE returned


def _size(payloads: Any) -> tuple[int, int]:
    """What one read brought into the worker: the payloads after interrupt markers
    (``interrupts.lua``; the stream is walked inside Redis)."""
    assert isinstance(payloads, list), payloads  # (a failed read is no bounded read)
    return len(payloads), sum(len(p) for p in payloads)


@contextlib.asynccontextmanager
async def _working(redis_factory: Any) -> AsyncIterator[Working]:
    """A worker whose turn of alice's "work" in ``web:a`` holds its model call; every
    stream read of the interrupt check is measured."""
    model = Model()
    loop = AgentLoop(
        RedisBus(redis_factory()),
        ScriptedProvider(handler=model),
        config=LoopConfig(read_block_ms=50),
    )
    interrupts = loop.controls.interrupts
    read: list[tuple[int, int]] = []
    real_carried = interrupts._carried

    def carried(member: str, scope: str, reply: Any) -> bool:
        read.append(_size(reply))
        return real_carried(member, scope, reply)

    interrupts._carried = carried  # type: ignore[method-assign]
    task = asyncio.create_task(loop.run())
    client = FrontendClient(redis_factory())
    try:
        await client.send(
            InboundMessage(id="w", channel="web", chat_id="a", sender_id="alice", content="work")
        )
        await asyncio.wait_for(model.holding.wait(), 10)
        yield Working(loop, model, client, read)
    finally:
        model.release.set()
        loop.stop()
        await asyncio.wait_for(task, 10)


async def _marker_then(w: Working, entries: list[dict[str, str]]) -> str:
    """An interrupt marker in web:a's stream followed by ``entries``, as a frontend of
    ``web`` may XADD them (it is granted XADD on its channel's inbound streams)."""
    raw, stream = w.loop.rt.bus.raw, w.loop.rt.bus.keys.inbound("web:a")
    marker = await raw.xadd(stream, {"control": "interrupt"})
    async with raw.pipeline(transaction=False) as pipe:
        for fields in entries:
            pipe.xadd(stream, fields)
        await pipe.execute()
    return marker.decode() if isinstance(marker, bytes) else str(marker)


async def test_an_interrupt_check_reads_a_bounded_number_of_bytes(redis_factory) -> None:  # type: ignore[no-untyped-def]
    """One interrupt published for a running turn, its marker followed by 63 entries of a
    payload's size (junk: no message the session takes): the check reads the stream
    from the marker. Every other look into a stream a frontend writes stops after 1 MiB
    (markers.lua, _openings.lua, shed_deleted, the put-off results); this one read
    ``SCAN`` entries whatever their size: 64 x 256 KiB = 16 MiB into the worker's event
    loop per interrupt heard (64 x proto-max-bulk-len at most)."""
    async with _working(redis_factory) as w:
        junk = [{"payload": "x" * PAYLOAD} for _ in range(INTERRUPT_SCAN - 1)]
        marker = await _marker_then(w, junk)
        w.loop.on_control(ControlMessage(op="interrupt", session_key="web:a", marker=marker))
        await w.loop.controls.interrupts.settled()
        w.model.release.set()
        got = await collect(w.client, "web", {"w"})
    assert got["w"][-1].content == "work done"  # refused: nothing of the session follows
    read_bytes = sum(b for _, b in w.read)  # every read this one interrupt cost
    # as the scripts' budgets: stop after the entry that crosses SCAN_BYTES
    assert read_bytes <= SCAN_BYTES + PAYLOAD + 1024, f"{read_bytes} bytes read by one check"


async def test_interrupts_published_again_do_not_read_the_same_entries_again(redis_factory) -> None:  # type: ignore[no-untyped-def]
    """A frontend publishes the same interrupt (one PUBLISH each, no new entry) a hundred
    times, each heard after the previous one was decided: every one read the same 64
    entries again (a pub/sub message costs the frontend ~60 bytes; each cost an XRANGE
    of 64 entries). The marker scan (markers.lua) memoises what it read "however often a
    frontend re-sets the hint"; the interrupt check should, too: the entries after a
    marker do not change, nor does the decision they gave for that running turn."""
    flood = 100
    async with _working(redis_factory) as w:
        small = [{"payload": "junk"} for _ in range(INTERRUPT_SCAN - 1)]
        marker = await _marker_then(w, small)
        for _ in range(flood):
            w.loop.on_control(ControlMessage(op="interrupt", session_key="web:a", marker=marker))
            await w.loop.controls.interrupts.settled()
        w.model.release.set()
        got = await collect(w.client, "web", {"w"})
    assert got["w"][-1].content == "work done"
    assert len(w.read) == 1, f"{flood} interrupts heard: {len(w.read)} reads"


# --- subagents: a stop flood for a session that once spawned here ------------------------


class SpawningModel:
    """Spawns a subagent on "research"; the subagent answers at once; echoes the rest."""

    async def __call__(self, **kw: Any) -> LLMResponse:
        from worker.agent.providers import ToolCallRequest

        last = kw["messages"][-1]
        if last["role"] == "user" and str(last["content"]).startswith("research"):
            call = ToolCallRequest("c1", "spawn", {"task": "look it up", "label": "r"})
            return LLMResponse(tool_calls=[call])
        if last["role"] == "user" and str(last["content"]).startswith("Task"):
            return LLMResponse(content="found: 42")
        return LLMResponse(content="ok")


async def test_a_stop_flood_for_a_session_that_spawned_here_costs_one_look(
    redis_factory, make_loop
) -> None:  # type: ignore[no-untyped-def]
    """A session spawned a subagent on this worker once (it finished long ago). Its
    frontend then publishes 10,000 stops for it (a PUBLISH each, nothing queued): every
    one started a background task of its own on the worker (``Subagents._abort``: an
    HGETALL of the session's registrations, then a drop each), so a flood of pub/sub
    messages held as many tasks and Redis round trips. ``Controls`` coalesces the same
    flood into one look (``test_a_control_flood_for_a_running_session_is_one_look``);
    the subagents' side of the control should too."""
    from replies import until

    loop = make_loop(ScriptedProvider(handler=SpawningModel()), followup_mode="queue")
    client = FrontendClient(redis_factory())
    await client.send(
        InboundMessage(id="q1", channel="web", chat_id="sa", sender_id="u", content="research")
    )
    await collect(client, "web", {"q1"}, timeout_s=10)
    spawned = loop.rt.bus.keys.spawned("web:sa")
    raw = redis_factory()

    async def done() -> bool:  # the subagent ran and its registration is gone
        return "web:sa" in loop.subagents.aborts.spawned_here.get(
            "web", {}
        ) and not await raw.exists(spawned)

    await until(done, timeout_s=10)
    aborts = 0
    real_abort = loop.subagents.aborts._abort

    def counted(session: str, at: tuple[int, int]) -> Any:
        nonlocal aborts
        aborts += 1
        return real_abort(session, at)

    loop.subagents.aborts._abort = counted  # type: ignore[method-assign]
    before = len(loop.rt.background)
    for _ in range(10_000):  # as heard by the listener, before any of them ran
        loop.on_control(ControlMessage(op="stop", session_key="web:sa"))
    held = len(loop.rt.background) - before
    await asyncio.gather(*list(loop.rt.background), return_exceptions=True)
    assert aborts <= 2, f"10,000 stops: {aborts} aborts, {held} tasks held at once"
    assert held <= 2, f"10,000 stops: {held} tasks held at once"


# --- markers at a stream's head (head() in _common.lua) ----------------------------------


async def test_markers_at_the_head_are_consumed_within_a_byte_budget_per_call(redis) -> None:  # type: ignore[no-untyped-def]
    """A frontend queues 64 stop markers, each padded with a field of a payload's size
    (it may XADD any fields to its streams), then a message. SECURITY.md: "every bound
    above counts entries and stops after the one that crosses a byte budget"; the
    marker scan (markers.lua) and the openings' look do, but the head's read of markers
    consumed all 64 (16 MiB read into the script) in one call, one stall of Redis for
    every channel. Asserted on what one call consumed, as test_bounded_work does."""
    from bus_redis.results import Acquired, Again, Entry

    key = "web:pad"
    bus = RedisBus(redis, lock_ttl_ms=5000)
    stream = bus.keys.inbound(key)
    n = 64
    for _ in range(n):
        async with redis.pipeline(transaction=False) as pipe:
            pipe.xadd(stream, {"control": "stop", "pad": "x" * PAYLOAD})
            pipe.incr(bus.keys.control_hint(key))
            await pipe.execute()
    await FrontendClient(redis).send(
        InboundMessage(channel="web", sender_id="u", chat_id="pad", content="after the stops")
    )
    got = await bus.acquire(key, "w1", member=key)
    assert isinstance(got, Acquired)
    consumed_first = n + 1 - await redis.xlen(stream)
    steps = [got.step]
    while isinstance(steps[-1], Again):
        steps.append(await bus.next(key, got.token, [key]))
    assert isinstance(steps[-1], Entry)  # the message after them is reached in the end
    per_call = SCAN_BYTES // PAYLOAD + 1  # stop after the marker that crosses 1 MiB
    assert consumed_first <= per_call, f"one call consumed {consumed_first} markers of 256 KiB"


# --- the control subscription: a flood of junk pub/sub messages ---------------------------


def test_a_flood_of_junk_controls_is_not_logged_line_by_line(caplog) -> None:  # type: ignore[no-untyped-def]
    """A frontend of ``web`` publishes 10,000 messages on its control channel that are no
    control (or name a session of another channel): each one was logged as a WARNING, so
    a PUBLISH of ~20 bytes wrote a log line on every worker serving the channel (the
    operator's disk and log pipeline, shared with every channel). The interrupts refused
    are counted and logged at debug for this reason ("a flood is not logged line by
    line", worker.runtime.interrupts); the junk controls should be too."""
    import logging

    from bus_redis import Keys
    from worker.runtime.subscription import ControlListener

    heard: list[ControlMessage] = []
    keys = Keys()
    listener = ControlListener(None, keys, heard.append, None)  # type: ignore[arg-type]
    channel = keys.control("web")
    caplog.set_level(logging.WARNING, logger="worker.runtime.subscription")
    for i in range(5_000):
        listener._take({"type": "message", "channel": channel, "data": f"junk {i}"})
        listener._take(
            {
                "type": "message",
                "channel": channel,
                "data": f'{{"v":2,"op":"stop","session_key":"telegram:{i}"}}',
            }
        )
    listener._take(
        {"type": "message", "channel": channel, "data": '{"v":2,"op":"stop","session_key":"web:a"}'}
    )
    assert [c.session_key for c in heard] == ["web:a"]  # the real one is still heard
    lines = [r for r in caplog.records if r.name == "worker.runtime.subscription"]
    assert len(lines) <= 100, f"10,000 junk controls: {len(lines)} warnings logged"


# --- the channel's subagent index (spawn_add.lua, put_off) --------------------------------


async def test_one_channels_spawns_and_put_offs_fill_only_its_own_subagent_index(redis) -> None:  # type: ignore[no-untyped-def]
    """(Found sound.) One channel's sessions register subagents past the channel's limit,
    and a put-off result re-dates its session's entry again and again: the channel's index
    holds at most ``channel_limit`` sessions (so spawn_add's unlimited ZRANGEBYSCORE of
    expired members reads at most that many), a put-off adds no member (ZADD XX), and
    another channel's spawn is still registered."""
    from bus_redis.subagents import SubagentStore

    bus = RedisBus(redis)
    store = SubagentStore(bus)

    async def add(session: str, sid: str, scope: str) -> int:
        await redis.set(bus.keys.lease(session), "t")
        return await store.add(
            session, "t", session, sid, '{"state":"queued"}',
            limit=2, channel_limit=8, scope=scope, scope_limit=2,
        )  # fmt: skip

    got = [await add(f"web:s{i}", f"sa{i}", f"web/scope:u{i}") for i in range(200)]
    assert got.count(1) == 8
    assert got.count(-2) == 192
    for i in range(100):  # put off again and again, for sessions in the index and not
        await store.put_off(f"web:s{i % 20}", f"sa{i % 20}", "result", "")
    assert await redis.zcard(bus.keys.subagents("web")) == 8
    assert await add("telegram:t", "sat", "telegram/scope:v") == 1
    assert await redis.zcard(bus.keys.subagents("telegram")) == 1
