"""The turn's last read of its stream, done by its commit (``CommitSpec.late_after``), on
fakeredis and a real redis-server: a turn that nothing joined reads its stream in no round
trip of its own; a message that arrives during the last model call refuses the commit, joins
the turn, and the session keeps each row once; one that cannot join gets its own turn after
the first answer; a stop reaches the turn while it goes on, and so does a stop or an
interrupt that comes while the refused commit is in flight."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from helpers import ScriptedProvider
from replies import collect

from bus_redis import FrontendClient, InboundMessage, RedisBus
from worker import AgentLoop, LoopConfig
from worker.agent.providers import LLMResponse


def _m(chat: str, text: str, id_: str, **kw: Any) -> InboundMessage:
    return InboundMessage(id=id_, channel="web", sender_id="u", chat_id=chat, content=text, **kw)


class Model:
    """Holds each call whose last message says "hold" until its event (in ``held``, in
    call order) is set; answers the rest at once."""

    def __init__(self) -> None:
        self.held: asyncio.Queue[asyncio.Event] = asyncio.Queue()
        self.calls: list[list[dict[str, Any]]] = []

    async def __call__(self, **kw: Any) -> LLMResponse:
        messages = kw["messages"]
        self.calls.append([dict(m) for m in messages])
        last = messages[-1]["content"]
        if "hold" in last:
            release = asyncio.Event()
            self.held.put_nowait(release)
            await release.wait()
        return LLMResponse(content=f"re: {last}")

    async def holding(self) -> asyncio.Event:
        return await asyncio.wait_for(self.held.get(), 10)


class Counted(RedisBus):
    """The bus, counting the turn's own reads of its stream; ``before_late_commit`` runs
    before the first commit that a later entry may refuse."""

    peeks = 0
    before_late_commit: Callable[[], Awaitable[None]] | None = None

    async def peek(self, member: str, *, after: str, count: int) -> list[tuple[str, str | None]]:
        Counted.peeks += 1
        return await super().peek(member, after=after, count=count)

    async def commit(self, key, token, worker_id, spec, *, select):  # type: ignore[no-untyped-def]
        hook, self.before_late_commit = self.before_late_commit, None
        if spec.late_after and hook is not None:
            await hook()
        else:
            self.before_late_commit = hook
        return await super().commit(key, token, worker_id, spec, select=select)


async def _start(redis_factory) -> tuple[AgentLoop, Model, asyncio.Task[None]]:  # type: ignore[no-untyped-def]
    Counted.peeks = 0
    model = Model()
    loop = AgentLoop(
        Counted(redis_factory()),
        ScriptedProvider(handler=model),
        config=LoopConfig(read_block_ms=100),
    )
    return loop, model, asyncio.create_task(loop.run())


async def _stop(loop: AgentLoop, task: asyncio.Task[None]) -> None:
    loop.stop()
    await asyncio.wait_for(task, 10)


async def _rows(loop: AgentLoop, key: str) -> list[tuple[str, str]]:
    stored = await loop.sessions.read_session(key)
    return [(m["role"], m.get("content")) for m in stored["messages"]]


async def test_a_turn_nothing_joins_reads_its_stream_in_no_round_trip_of_its_own(
    redis_factory,
) -> None:  # type: ignore[no-untyped-def]
    loop, _, task = await _start(redis_factory)
    client = FrontendClient(redis_factory())
    for i in range(3):
        assert (await client.ask(_m("n", f"q{i}", f"m{i}"), timeout_s=10)).content == f"re: q{i}"
    await _stop(loop, task)

    assert Counted.peeks == 0  # the commits checked: nothing had arrived
    assert await _rows(loop, "web:n") == [
        r for i in range(3) for r in (("user", f"q{i}"), ("assistant", f"re: q{i}"))
    ]


async def test_a_message_arriving_during_the_last_model_call_joins_and_each_row_is_kept_once(
    redis_factory,
) -> None:  # type: ignore[no-untyped-def]
    loop, model, task = await _start(redis_factory)
    client = FrontendClient(redis_factory())
    await client.send(_m("j", "hold on", "a"))
    release = await model.holding()
    await client.send(_m("j", "and this", "b"))  # arrives while the model answers "a"
    release.set()
    got = await collect(client, "web", {"a", "b"})
    await _stop(loop, task)

    assert got["b"][-1] is got["a"][-1]  # one answer covers both
    assert got["a"][-1].content == "re: and this"
    assert Counted.peeks >= 1  # refused once, the turn read what arrived
    assert model.calls[-1][-2:] == [
        {"role": "assistant", "content": "re: hold on"},
        {"role": "user", "content": "and this"},
    ]
    # the refused commit wrote nothing, and the rows its outcome had added were forgotten
    assert await _rows(loop, "web:j") == [
        ("user", "hold on"),
        ("assistant", "re: hold on"),
        ("user", "and this"),
        ("assistant", "re: and this"),
    ]
    assert await client.redis.xlen(client.keys.inbound("web:j")) == 0  # both consumed


async def test_a_late_message_that_cannot_join_gets_its_own_turn_after_the_answer(
    redis_factory,
) -> None:  # type: ignore[no-untyped-def]
    loop, model, task = await _start(redis_factory)
    client = FrontendClient(redis_factory())
    await client.send(_m("q", "hold on", "a"))
    release = await model.holding()
    await client.send(_m("q", "next", "b", followup="queue"))
    release.set()
    got = await collect(client, "web", {"a", "b"})
    await _stop(loop, task)

    assert got["a"][-1].content == "re: hold on"
    assert got["b"][-1].content == "re: next"
    assert got["b"][-1] is not got["a"][-1]
    assert len([e for e in got["a"] if e.is_terminal]) == 1  # answered once
    assert await _rows(loop, "web:q") == [
        ("user", "hold on"),
        ("assistant", "re: hold on"),
        ("user", "next"),
        ("assistant", "re: next"),
    ]


async def test_a_stop_reaches_the_turn_while_it_goes_on(redis_factory) -> None:  # type: ignore[no-untyped-def]
    loop, model, task = await _start(redis_factory)
    client = FrontendClient(redis_factory())
    await client.send(_m("s", "hold on", "a"))
    first = await model.holding()
    await client.send(_m("s", "hold that too", "b"))  # joins: the model holds again
    first.set()
    second = await model.holding()  # the turn goes on with "b"
    await client.stop("web:s")
    got = await collect(client, "web", {"a", "b"})
    second.set()
    await _stop(loop, task)

    assert got["a"][-1].code == "cancelled"
    assert got["b"][-1] is got["a"][-1]
    assert len(model.calls) == 2


@pytest.mark.parametrize("op", ["stop", "interrupt"])
async def test_a_control_while_a_refused_commit_is_in_flight_reaches_the_turn_going_on(
    redis_factory, op: str
) -> None:  # type: ignore[no-untyped-def]
    loop, model, task = await _start(redis_factory)
    client = FrontendClient(redis_factory())
    seen = asyncio.Event()
    handle = loop.controls.on_control

    def on_control(control: Any) -> None:
        handle(control)
        seen.set()

    loop.controls.on_control = on_control  # type: ignore[method-assign]

    async def control() -> None:  # the worker has it before the commit is refused
        if op == "interrupt":
            await client.send(_m("w", "new topic", "c", followup="interrupt"))
        else:
            await client.stop("web:w")
        await asyncio.wait_for(seen.wait(), 10)
        await loop.controls.interrupts.settled()  # (an interrupt first reads its message)

    assert isinstance(loop.bus, Counted)
    loop.bus.before_late_commit = control
    await client.send(_m("w", "hold on", "a"))
    first = await model.holding()
    await client.send(_m("w", "and b", "b"))  # arrives during the last model call
    first.set()
    got = await collect(client, "web", {"a", "b"} | ({"c"} if op == "interrupt" else set()))
    await _stop(loop, task)

    assert got["a"][-1].code == "cancelled"
    assert op in got["a"][-1].content
    # cancelled as it went on: no model call for "and b" as part of a's turn
    assert not any(
        c[-2:-1] == [{"role": "assistant", "content": "re: hold on"}] for c in model.calls
    )
    rows = await _rows(loop, "web:w")
    assert ("assistant", "re: hold on") not in rows  # the user never got it


def test_a_holder_ends_only_its_own_slot() -> None:
    from worker.runtime.inflight import TurnRegistry

    turns = TurnRegistry()
    old = turns.begin("web:k", "web:k", "1-0")
    new = turns.begin("web:k", "web:k", "2-0")  # a newer holder of K began meanwhile
    assert turns.end("web:k", old) is None
    assert turns.running() == {"web:k": ("web:k", "2-0")}
    turns.cancel("web:k", "stop")
    assert turns.end("web:k", new) == "stop"
    assert turns.running() == {}


async def test_a_holder_finishing_after_its_commit_leaves_the_next_turn_stoppable(
    redis_factory,
) -> None:  # type: ignore[no-untyped-def]
    loop, model, task = await _start(redis_factory)
    client = FrontendClient(redis_factory())
    finishing, go, finished = asyncio.Event(), asyncio.Event(), asyncio.Event()
    consolidate = loop.rt.maybe_consolidate

    async def slow_after_commit(session: Any) -> Any:  # the holder of "a", lease released
        if finishing.is_set():
            return await consolidate(session)
        finishing.set()
        await go.wait()
        try:
            return await consolidate(session)
        finally:
            finished.set()  # the rest of that holder's entry runs without awaiting

    loop.rt.maybe_consolidate = slow_after_commit
    await client.send(_m("y", "first", "a"))
    await asyncio.wait_for(finishing.wait(), 10)
    await client.send(_m("y", "hold b", "b"))  # served by another holder of web:y
    release = await model.holding()
    go.set()
    await asyncio.wait_for(finished.wait(), 10)  # the first holder has finished its entry
    await client.stop("web:y")
    got = await collect(client, "web", {"a", "b"})
    release.set()
    await _stop(loop, task)

    assert got["a"][-1].content == "re: first"
    assert got["b"][-1].code == "cancelled"


async def test_an_answer_on_the_last_model_call_allowed_stands(redis_factory) -> None:  # type: ignore[no-untyped-def]
    model = Model()
    loop = AgentLoop(
        Counted(redis_factory()),
        ScriptedProvider(handler=model),
        config=LoopConfig(read_block_ms=100, max_iterations=1),
    )
    task = asyncio.create_task(loop.run())
    client = FrontendClient(redis_factory())
    await client.send(_m("m", "hold on", "a"))
    release = await model.holding()
    await client.send(_m("m", "and b", "b"))  # arrives during the only model call allowed
    release.set()
    got = await collect(client, "web", {"a", "b"})
    await _stop(loop, task)

    assert got["a"][-1].content == "re: hold on"  # not the iteration limit's text
    assert got["b"][-1].content == "re: and b"  # its own turn


async def test_a_session_flooded_during_every_model_call_ends_its_turn_after_five_joins(
    redis_factory,
) -> None:  # type: ignore[no-untyped-def]
    """Each model call sees one more message arrive: every commit is refused, but the
    turn joins at most MAX_INJECTION_CYCLES times, then its answer stands; the rest get
    turns of their own, and another channel is served meanwhile."""
    from worker.agent.runner import MAX_INJECTION_CYCLES

    client = FrontendClient(redis_factory())
    sent = ["f0"]
    calls: list[str] = []

    async def flooding(**kw: Any) -> LLMResponse:
        last = kw["messages"][-1]["content"]
        calls.append(last)
        if last != "hi" and len(sent) < 12:  # (the other channel's call adds nothing)
            sent.append(f"f{len(sent)}")
            await client.send(_m("flood", f"more {sent[-1]}", sent[-1]))
        return LLMResponse(content=f"re: {last}")

    loop = AgentLoop(
        Counted(redis_factory()),
        ScriptedProvider(handler=flooding),
        config=LoopConfig(read_block_ms=100),
    )
    task = asyncio.create_task(loop.run())
    await client.send(_m("flood", "start", "f0"))
    other = InboundMessage(id="o", channel="telegram", sender_id="u", chat_id="t", content="hi")
    assert (await client.ask(other, timeout_s=10)).content == "re: hi"
    want = {f"f{i}" for i in range(12)}  # the flood stops at 12
    got = await collect(client, "web", want)
    await _stop(loop, task)

    first = got["f0"][-1]
    assert first.covers is not None
    assert len(first.covers) == 1 + MAX_INJECTION_CYCLES  # "start" and five joined
    assert sorted(sent) == sorted(want)
    assert all(got[s][-1].is_terminal for s in want)  # every one answered
