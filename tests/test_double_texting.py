"""Double texting over the wire, on fakeredis and a real redis-server: what a second message
does while its session's turn runs — ``inject`` (join it), ``queue`` (wait), ``interrupt``
(cancel it, keep its complete tool exchanges, start again with everything pending) and
``reject`` (``busy`` at once, nothing queued); a deployment default and a per-message
override (README: Double texting)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from helpers import ScriptedProvider
from replies import collect, until

from bus_redis import FrontendClient, InboundMessage, RedisBus, SessionBusyError
from worker import AgentLoop, LoopConfig
from worker.agent.providers import LLMResponse, ToolCallRequest


def _m(chat: str, text: str, id_: str, **kw: Any) -> InboundMessage:
    return InboundMessage(id=id_, channel="web", sender_id="u", chat_id=chat, content=text, **kw)


class Model:
    """Calls a tool on "work", then holds its next call until released; answers the rest."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.holding = asyncio.Event()
        self.calls: list[list[dict[str, Any]]] = []

    async def __call__(self, **kw: Any) -> LLMResponse:
        messages = kw["messages"]
        self.calls.append(messages)
        last = messages[-1]
        if last["role"] == "user" and last["content"] == "work":
            return LLMResponse(tool_calls=[ToolCallRequest("c1", "create_goal", {"title": "g"})])
        if last["role"] == "tool":
            self.holding.set()
            await self.release.wait()
            return LLMResponse(content="work done")
        return LLMResponse(content=f"re: {last['content']}")


async def _start(
    redis_factory, config: LoopConfig | None = None
) -> tuple[AgentLoop, Model, asyncio.Task[None]]:  # type: ignore[no-untyped-def]
    model = Model()
    loop = AgentLoop(
        RedisBus(redis_factory()),
        ScriptedProvider(handler=model),
        config=config or LoopConfig(read_block_ms=100),
    )
    return loop, model, asyncio.create_task(loop.run())


async def _stop(loop: AgentLoop, task: asyncio.Task[None]) -> None:
    loop.stop()
    await asyncio.wait_for(task, 10)


async def test_interrupt_cancels_the_turn_keeps_its_work_and_runs_everything_pending(
    redis_factory,
) -> None:  # type: ignore[no-untyped-def]
    loop, model, task = await _start(redis_factory)
    client = FrontendClient(redis_factory())
    await client.send(_m("i", "work", "a"))
    await asyncio.wait_for(model.holding.wait(), 10)  # a tool exchange done, the model busy
    await client.send(_m("i", "also this", "b", followup="queue"))  # queued meanwhile
    await client.send(_m("i", "no, do that", "c", followup="interrupt"))
    got = await collect(client, "web", {"a", "b", "c"})
    model.release.set()
    await _stop(loop, task)

    assert got["a"][-1].code == "cancelled"
    assert "interrupt" in got["a"][-1].content
    assert got["b"][-1].type == "message"  # pending input is not cancelled: it runs
    assert got["c"][-1].type == "message"
    stored = await loop.sessions.read_session("web:i")
    roles = [(m["role"], m.get("content")) for m in stored["messages"]]
    assert roles[:3] == [("user", "work"), ("assistant", ""), ("tool", roles[2][1])]  # kept
    assert ("user", "no, do that") in roles
    seen_by_c = next(c for c in model.calls if c[-1].get("content") == "no, do that")
    assert any(m.get("tool_call_id") == "c1" for m in seen_by_c)  # the kept work is in view


async def test_reject_refuses_at_once_while_busy_and_queues_nothing(redis_factory) -> None:  # type: ignore[no-untyped-def]
    loop, model, task = await _start(redis_factory)
    client = FrontendClient(redis_factory(), followup="reject")  # this frontend's default
    await client.send(_m("r", "work", "a"))  # idle: accepted
    await asyncio.wait_for(model.holding.wait(), 10)
    with pytest.raises(SessionBusyError) as busy:
        await client.send(_m("r", "are you there?", "b"))
    assert busy.value.code == "busy"
    assert await client.redis.xlen(client.keys.inbound("web:r")) == 1  # only the running one
    model.release.set()
    await collect(client, "web", {"a"})
    assert (await client.ask(_m("r", "now?", "c"), timeout_s=10)).content == "re: now?"
    await _stop(loop, task)


@pytest.mark.parametrize(("deployment", "override"), [("inject", "queue"), ("inject", "inject")])
async def test_a_message_may_override_the_deployments_mode(
    redis_factory, deployment: str, override: str
) -> None:  # type: ignore[no-untyped-def]
    config = LoopConfig(read_block_ms=100, followup_mode=deployment)  # type: ignore[arg-type]
    loop, model, task = await _start(redis_factory, config)
    client = FrontendClient(redis_factory())
    await client.send(_m("o", "work", "a"))
    await asyncio.wait_for(model.holding.wait(), 10)
    await client.send(_m("o", "and this", "b", followup=override))
    await client.send(_m("o", "and that", "c"))  # the deployment's mode
    model.release.set()
    got = await collect(client, "web", {"a", "b", "c"})
    await _stop(loop, task)

    joined_a = {k for k in ("b", "c") if got[k][-1] is got["a"][-1]}
    # inject joins the running turn at its last model boundary; queue gets its own turn,
    # and the first message that does not join stops the pull (order is kept)
    assert joined_a == ({"b", "c"} if override == "inject" else set())


async def test_a_stop_after_an_interrupt_still_covers_what_was_queued_before_it(
    redis_factory,
) -> None:  # type: ignore[no-untyped-def]
    """Review: the interrupt marker once counted in the marker hint, and consuming it could
    zero a later stop's hint, so a message queued before that stop ran."""
    holding = {k: asyncio.Event() for k in ("hold-a", "hold-b")}
    release = asyncio.Event()

    async def model(**kw: Any) -> LLMResponse:
        last = kw["messages"][-1]["content"]
        if last in holding:
            holding[last].set()
            await release.wait()
        return LLMResponse(content=f"re: {last}")

    config = LoopConfig(read_block_ms=100, followup_mode="queue")
    loop = AgentLoop(RedisBus(redis_factory()), ScriptedProvider(handler=model), config=config)
    task = asyncio.create_task(loop.run())
    client = FrontendClient(redis_factory())
    await client.send(_m("h", "hold-a", "a"))
    await asyncio.wait_for(holding["hold-a"].wait(), 10)
    await client.send(_m("h", "hold-b", "b"))
    await client.send(_m("h", "c", "c", followup="interrupt"))
    await asyncio.wait_for(holding["hold-b"].wait(), 10)  # a cancelled, b running
    await client.stop("web:h")  # covers b and c, both published before it
    got = await collect(client, "web", {"a", "b", "c"})
    release.set()
    await _stop(loop, task)
    assert [got[k][-1].code for k in "abc"] == ["cancelled", "cancelled", "cancelled"]
    assert "interrupt" in got["a"][-1].content
    assert "stop" in got["b"][-1].content


async def test_an_id_answered_before_and_sent_again_during_a_later_turn_gets_its_own_answer(
    redis_factory,
) -> None:  # type: ignore[no-untyped-def]
    """inject: a message id answered by an earlier turn, sent again while a later
    message's turn runs, must not join that turn (covered by its answer, the model never
    told): it is answered on its own as any re-sent id is, with its first answer marked
    ``duplicate`` (README: Idempotency). A wire review found it joined and was covered."""
    config = LoopConfig(read_block_ms=100, followup_mode="inject")
    loop, model, task = await _start(redis_factory, config)
    client = FrontendClient(redis_factory())
    await client.send(_m("d", "first", "x"))
    await collect(client, "web", {"x"})
    await client.send(_m("d", "work", "a"))
    await asyncio.wait_for(model.holding.wait(), 10)
    await client.send(_m("d", "first", "x"))  # the same id again, while "a" runs
    await client.send(_m("d", "and this", "b"))  # a new one after it
    model.release.set()
    got = await collect(client, "web", {"a", "b"})
    await until_terminal(client, "x", 2)
    got = await collect(client, "web", {"x"})
    await _stop(loop, task)

    a_answer = next(e for e in got["a"] if e.is_terminal)
    assert "x" not in (a_answer.covers or []), "the old id was covered by a later turn"
    first, again = [e for e in got["x"] if e.is_terminal]
    assert (first.content, again.content) == ("re: first", "re: first")
    assert (again.metadata or {}).get("duplicate") is True


async def until_terminal(client: FrontendClient, rid: str, n: int) -> None:
    """Until reply id ``rid`` has ``n`` terminal events."""

    async def enough() -> bool:
        got = await collect(client, "web", {rid})
        return sum(1 for e in got[rid] if e.is_terminal) >= n

    await until(enough, timeout_s=20)
