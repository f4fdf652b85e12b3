"""The worker in-process (AgentLoop.run) on fakeredis and a real redis-server: poison
messages, duplicates, bad input, controls for queued turns, stop keeping partial output."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from helpers import ScriptedProvider
from inprocess import cancelled, in_process_turn
from replies import collect

from bus_redis import FrontendClient, InboundMessage, Keys, RedisBus
from worker import AgentLoop, LoopConfig
from worker.agent.providers import LLMResponse, ToolCallRequest


def _m(chat: str, text: str, **kw: object) -> InboundMessage:
    return InboundMessage(
        id=f"{chat}:{text}", channel="web", sender_id="u", chat_id=chat, content=text, **kw
    )  # type: ignore[arg-type]


async def _echo(**kw: object) -> LLMResponse:
    messages = kw["messages"]
    assert isinstance(messages, list)
    text = str(messages[-1]["content"])
    if "poison" in text:
        raise RuntimeError("this message breaks the turn")
    return LLMResponse(content=f"re: {text}")


@pytest.fixture
async def running(
    redis_factory,
) -> AsyncIterator[tuple[AgentLoop, FrontendClient, ScriptedProvider]]:  # type: ignore[no-untyped-def]
    provider = ScriptedProvider(handler=_echo)
    loop = AgentLoop(
        RedisBus(redis_factory()), provider, config=LoopConfig(max_deliveries=3, read_block_ms=100)
    )
    task = asyncio.create_task(loop.run())
    yield loop, FrontendClient(redis_factory()), provider
    loop.stop()
    await asyncio.wait_for(task, 10)


async def test_poison_message_is_dead_lettered_and_the_session_moves_on(running) -> None:  # type: ignore[no-untyped-def]
    _loop, client, _ = running
    bad = await client.send(_m("p", "poison pill"))
    good = await client.send(_m("p", "fine"))
    got = await collect(client, "web", {bad, good})

    assert got[bad][-1].code == "dead_lettered"
    assert got[good][-1].content == "re: fine"
    dead = await client.redis.xrange(Keys().dead("web"))
    doc = json.loads(dead[0][1]["entry"])
    assert doc["reason"] == "failed 3 times; last error: RuntimeError"
    assert doc["deliveries"] == 4
    assert "poison pill" in doc["payload"]


async def test_resent_id_is_answered_again_without_a_second_turn(running) -> None:  # type: ignore[no-untyped-def]
    loop, client, provider = running
    first = await client.send(_m("d", "once"))
    await collect(client, "web", {first})
    again = await client.send(_m("d", "once"))
    later = await client.send(_m("d", "next"))
    got = await collect(client, "web", {later})

    assert again == first
    answers = [ev for ev in got[first] if ev.is_terminal]
    assert [(a.content, a.metadata.get("duplicate")) for a in answers] == [
        ("re: once", None),
        ("re: once", True),
    ]
    assert [c["messages"][-1]["content"] for c in provider.calls] == ["once", "next"]
    stored = await loop.sessions.read_session("web:d")
    assert [m["content"] for m in stored["messages"] if m["role"] == "user"] == ["once", "next"]


async def test_an_id_sent_again_while_its_turn_runs_joins_it_as_nothing(redis_factory) -> None:  # type: ignore[no-untyped-def]
    """A frontend that re-sends a message (a replica died, the page retried) while its turn
    is still answering it: the copy is consumed by that turn, never asked of the model
    again nor stored twice, and the one answer covers both."""
    gate = asyncio.Event()

    async def held(**kw: object) -> LLMResponse:
        await gate.wait()  # until the copy is queued behind the running turn
        return await _echo(**kw)

    provider = ScriptedProvider(handler=held)
    loop = AgentLoop(RedisBus(redis_factory()), provider, config=LoopConfig(read_block_ms=100))
    task = asyncio.create_task(loop.run())
    client = FrontendClient(redis_factory())
    try:
        first = await client.send(_m("r", "slow"))
        await provider.started.wait()
        again = await client.send(_m("r", "slow"))
        gate.set()
        got = await collect(client, "web", {first})
        later = await client.send(_m("r", "next"))  # after the answer: a turn of its own
        await collect(client, "web", {later})
    finally:
        loop.stop()
        await asyncio.wait_for(task, 10)

    assert again == first
    assert [ev.content for ev in got[first] if ev.is_terminal] == ["re: slow"]
    assert [c["messages"][-1]["content"] for c in provider.calls] == ["slow", "next"]
    stored = await loop.sessions.read_session("web:r")
    assert [(m["role"], m["content"]) for m in stored["messages"]] == [
        ("user", "slow"),
        ("assistant", "re: slow"),
        ("user", "next"),
        ("assistant", "re: next"),
    ]


@pytest.mark.parametrize(
    ("payload", "code"),
    [
        ("not json at all", "invalid_message"),
        ('{"v":2,"channel":"web","chat_id":"b","sender_id":"u","content":5}', "invalid_message"),
        ('{"v":9,"channel":"web","chat_id":"b","sender_id":"u"}', "invalid_message"),
        (
            '{"v":2,"channel":"web","chat_id":"b","sender_id":"u","content":"'
            + "x" * 300_000
            + '"}',
            "too_large",
        ),
        (
            '{"v":2,"op":"discard","session_key":"web:b","channel":"web","chat_id":"b"}',
            "invalid_message",
        ),
        ('{"v":2,"channel":"web","chat_id":"zz","sender_id":"u"}', "invalid_message"),
        (
            b'{"v":2,"channel":"web","chat_id":"b","sender_id":"u","content":"\xff"}',
            "invalid_message",
        ),
    ],
)
async def test_bad_input_gets_an_error_and_a_dead_letter(
    running, payload: str | bytes, code: str
) -> None:  # type: ignore[no-untyped-def]
    """Including a payload for another session than its stream (chat zz in web:b's stream)
    and bytes that are not UTF-8: answered once, dead-lettered, the session goes on."""
    _loop, client, _ = running
    bad = await client.send_raw("web:b", payload)
    ok = await client.send(_m("b", "still alive"))
    got = await collect(client, "web", {ok})

    errors = [ev for evs in got.values() for ev in evs if ev.type == "error"]
    assert [e.code for e in errors] == [code]
    assert errors[0].session_key == "web:b"
    assert errors[0].reply_to == bad  # it names the entry it answers
    assert got[ok][-1].content == "re: still alive"
    assert await client.redis.xlen(Keys().dead("web")) == 1
    assert await client.redis.xlen(Keys().inbound("web:b")) == 0


async def test_stop_cancels_queued_turns_of_the_session_too(redis_factory) -> None:  # type: ignore[no-untyped-def]
    gate = asyncio.Event()

    async def slow(**kw: object) -> LLMResponse:
        await gate.wait()
        return await _echo(**kw)

    provider = ScriptedProvider(handler=slow)
    loop = AgentLoop(RedisBus(redis_factory()), provider, config=LoopConfig(read_block_ms=100))
    client = FrontendClient(redis_factory())
    task = asyncio.create_task(loop.run())
    ids = [await client.send(_m("q", f"m{i}")) for i in range(3)]
    await asyncio.wait_for(provider.started.wait(), 5)
    await client.stop("web:q")
    after = await client.send(_m("q", "after stop"))
    await collect(client, "web", {ids[0]})  # the running turn is cancelled, not finished
    gate.set()
    got = await collect(client, "web", {*ids, after})
    loop.stop()
    await asyncio.wait_for(task, 10)

    assert [got[i][-1].code for i in ids] == ["cancelled"] * 3
    assert got[after][-1].content == "re: after stop"
    assert len(provider.calls) == 2  # the running turn and the one after the stop


async def test_stop_keeps_partial_output_up_to_the_last_complete_tool_step(redis_factory) -> None:  # type: ignore[no-untyped-def]
    step = 0
    blocked = asyncio.Event()

    async def tool_then_block(**_kw: object) -> LLMResponse:
        nonlocal step
        step += 1
        if step == 1:
            return LLMResponse(tool_calls=[ToolCallRequest("c1", "create_goal", {"title": "ship"})])
        blocked.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    provider = ScriptedProvider(handler=tool_then_block)
    loop = AgentLoop(RedisBus(redis_factory()), provider, config=LoopConfig(read_block_ms=100))
    client = FrontendClient(redis_factory())
    task = asyncio.create_task(loop.run())
    mid = await client.send(_m("s", "plan it"))
    await asyncio.wait_for(blocked.wait(), 5)
    await client.stop("web:s")
    got = await collect(client, "web", {mid})
    loop.stop()
    await asyncio.wait_for(task, 10)

    assert got[mid][-1].code == "cancelled"
    stored = await loop.sessions.read_session("web:s")
    assert [m["role"] for m in stored["messages"]] == ["user", "assistant", "tool"]
    assert stored["metadata"]["goals"][0]["title"] == "ship"


@pytest.mark.real_redis
async def test_control_missed_while_pubsub_was_down_still_cancels(redis_server) -> None:  # type: ignore[no-untyped-def]
    redis = aioredis.from_url(redis_server.url, decode_responses=True)
    await redis.flushall()

    async def block(**_kw: object) -> LLMResponse:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    provider = ScriptedProvider(handler=block)
    loop = AgentLoop(RedisBus(redis), provider, config=LoopConfig(read_block_ms=100))
    client = FrontendClient(aioredis.from_url(redis_server.url, decode_responses=True))
    task = asyncio.create_task(loop.run())
    mid = await client.send(_m("x", "long turn"))
    await asyncio.wait_for(provider.started.wait(), 5)
    # The control's publish is lost: only its marker is queued; then the subscription drops.
    await client.redis.xadd(Keys().inbound("web:x"), {"control": "stop"})
    await client.redis.incr(Keys().control_hint("web:x"))
    await client.redis.client_kill_filter(_type="pubsub")
    got = await collect(client, "web", {mid}, timeout_s=10)
    loop.stop()
    await asyncio.wait_for(task, 10)
    assert got[mid][-1].code == "cancelled"
    await client.redis.aclose()
    await redis.aclose()


async def test_concurrency_caps_turns_per_process(redis_factory) -> None:  # type: ignore[no-untyped-def]
    """Six sessions, a cap of two: while two turns are held, the others wait for a slot
    (checked by holding them long enough for a third to start if the cap did not hold)."""
    cap, sessions = 2, 6
    in_flight: list[asyncio.Event] = []
    peak = 0
    changed = asyncio.Condition()

    async def gated(**kw: object) -> LLMResponse:
        nonlocal peak
        gate = asyncio.Event()
        async with changed:
            in_flight.append(gate)
            peak = max(peak, len(in_flight))
            changed.notify_all()
        await gate.wait()
        async with changed:
            in_flight.remove(gate)
            changed.notify_all()
        return await _echo(**kw)

    provider = ScriptedProvider(handler=gated)
    loop = AgentLoop(
        RedisBus(redis_factory()), provider, config=LoopConfig(concurrency=cap, read_block_ms=100)
    )
    client = FrontendClient(redis_factory())
    ids = {await client.send(_m(f"c{i}", "hello")) for i in range(sessions)}
    task = asyncio.create_task(loop.run())
    for left in range(sessions, 0, -1):
        async with changed:
            await changed.wait_for(lambda n=left: len(in_flight) >= min(cap, n))  # type: ignore[misc]
        await _settle(loop)  # every notification read meanwhile had its chance to start
        assert len(in_flight) == min(cap, left)
        in_flight[0].set()
        async with changed:
            await changed.wait_for(lambda n=left: len(in_flight) < min(cap, n))  # type: ignore[misc]
    got = await collect(client, "web", ids)
    loop.stop()
    await asyncio.wait_for(task, 10)

    assert len(got) == sessions
    assert peak == cap


async def _settle(loop: AgentLoop) -> None:
    """Let the worker run until it waits on Redis or a gate: a few read timeouts' worth."""
    await asyncio.sleep(3 * loop.config.read_block_ms / 1000)  # bounded, not a sync point


async def test_stopping_worker_finishes_its_turn_and_hands_the_rest_over(redis_factory) -> None:  # type: ignore[no-untyped-def]
    gate = asyncio.Event()

    async def slow(**kw: object) -> LLMResponse:
        await gate.wait()
        return await _echo(**kw)

    first = ScriptedProvider(handler=slow)
    loop_a = AgentLoop(
        RedisBus(redis_factory()), first, config=LoopConfig(worker_id="a", read_block_ms=100)
    )
    client = FrontendClient(redis_factory())
    ids = [await client.send(_m("h", f"m{i}")) for i in range(3)]
    run_a = asyncio.create_task(loop_a.run())
    await asyncio.wait_for(first.started.wait(), 5)
    loop_a.stop()  # as SIGTERM does
    gate.set()
    await asyncio.wait_for(run_a, 10)

    assert len(first.calls) == 1  # took no new work after the stop
    assert await client.redis.xlen(Keys().inbound("web:h")) == 2
    second = ScriptedProvider(handler=_echo)
    loop_b = AgentLoop(
        RedisBus(redis_factory()), second, config=LoopConfig(worker_id="b", read_block_ms=100)
    )
    run_b = asyncio.create_task(loop_b.run())
    got = await collect(client, "web", set(ids))
    loop_b.stop()
    await asyncio.wait_for(run_b, 10)

    assert [got[i][-1].metadata["worker"] for i in ids] == ["a", "b", "b"]


async def test_a_message_answered_provider_error_can_be_retried_with_its_id(make_loop) -> None:  # type: ignore[no-untyped-def]
    """The page's Retry after a provider error re-sends the same id: the turn runs again,
    the user row stays once, and a later re-send is a duplicate of the answer."""
    from worker.agent.providers import ProviderError

    prompts: list[list[dict[str, object]]] = []

    async def flaky(**kw: object) -> LLMResponse:
        prompts.append(list(kw["messages"]))  # type: ignore[call-overload]
        if len(prompts) == 1:
            raise ProviderError("InternalServerError: scripted")
        return LLMResponse(content="finally")

    loop = make_loop(ScriptedProvider(handler=flaky))
    client = FrontendClient(loop.bus.redis)
    msg = _m("r", "hello?")
    first = await client.ask(msg, timeout_s=10)
    assert first.code == "provider_error"
    again = await client.ask(msg, timeout_s=10)
    assert again.type == "message"
    assert again.content == "finally"
    assert [m["content"] for m in prompts[1] if m["role"] == "user"] == ["hello?"]
    third = await client.ask(msg, timeout_s=10)
    assert third.content == "finally"
    assert third.metadata.get("duplicate") is True
    assert len(prompts) == 2
    rows = [(r["role"], r["content"]) for r in (await loop.sessions.store.load("web:r")).messages]  # type: ignore[union-attr]
    assert rows == [("user", "hello?"), ("assistant", "finally")]


async def test_a_stop_before_the_loop_began_is_kept_and_it_runs_again_after(
    redis_factory,
) -> None:  # type: ignore[no-untyped-def]
    """(Found by tests/test_control_sequences.py.) ``run()`` cleared the stop request as it
    began, so a ``stop()`` that came first (a task created and stopped at once, a SIGTERM
    while an embedding program was still starting) was lost: the loop served until
    cancelled. The request is cleared when the loop ends now, so it can run again."""
    loop = AgentLoop(RedisBus(redis_factory()), ScriptedProvider(["again"]))
    task = asyncio.create_task(loop.run())
    loop.stop()
    done, _ = await asyncio.wait({task}, timeout=10)  # (wait_for's cancel would end it)
    assert done, "the stop was lost: the loop serves on"
    assert not await redis_factory().exists(Keys().worker_info(loop.worker_id))

    task = asyncio.create_task(loop.run())
    client = FrontendClient(redis_factory())
    reply = await client.ask(
        InboundMessage(id="a", channel="web", sender_id="u", chat_id="again", content="hi"),
        timeout_s=10,
    )
    assert reply.content == "again"
    loop.stop()
    await asyncio.wait_for(task, 10)


async def test_an_in_process_turn_is_stopped_by_a_marker_of_the_millisecond_it_began(  # type: ignore[no-untyped-def]
    redis, make_loop, monkeypatch
) -> None:
    """``process_message`` runs under an id made of the clock, meant to come before any
    control published from then on. It was ``<ms>-0``: a marker written in that same
    millisecond (``<ms>-0`` too) was taken for one before the turn and the stop was lost
    (a second reading's test failed so under load, stop 52). Its id is now the last of the
    millisecond before: a marker of the turn's own millisecond comes after it."""
    import time

    from bus_redis import ControlMessage

    ms = int(time.time() * 1000) + 60_000  # (a millisecond no entry of the stream has yet)
    loop, turn = await in_process_turn(make_loop, monkeypatch, 0.0, started=False, now_ms=ms)
    marker = await redis.xadd(Keys().inbound("web:ms"), {"control": "stop"}, id=f"{ms}-0")
    loop.on_control(ControlMessage(op="stop", session_key="web:ms", marker=str(marker)))
    await cancelled(turn, "the stop of the turn's own millisecond was ignored")
