"""Tools inside turns: progress events, disabled tools are neither offered nor executable."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis
from helpers import ScriptedProvider
from replies import collect

from bus_redis import FrontendClient, InboundMessage, RedisBus
from worker import AgentLoop, LoopConfig
from worker.agent.providers import LLMResponse, ToolCallRequest


def _script(*steps: LLMResponse) -> ScriptedProvider:
    queue = list(steps)

    async def handler(**_kw: object) -> LLMResponse:
        return queue.pop(0)

    return ScriptedProvider(handler=handler)


async def test_message_tool_sends_progress_before_the_answer(redis_factory) -> None:  # type: ignore[no-untyped-def]
    provider = _script(
        LLMResponse(tool_calls=[ToolCallRequest("c1", "message", {"content": "working on it"})]),
        LLMResponse(content="done"),
    )
    loop = AgentLoop(RedisBus(redis_factory()), provider, config=LoopConfig(read_block_ms=100))
    client = FrontendClient(redis_factory())
    task = asyncio.create_task(loop.run())
    mid = await client.send(
        InboundMessage(id="m1", channel="web", sender_id="u", chat_id="t", content="go")
    )
    got = await collect(client, "web", {mid})
    loop.stop()
    await asyncio.wait_for(task, 10)

    assert [(ev.type, ev.content) for ev in got[mid]] == [
        ("progress", "working on it"),
        ("message", "done"),
    ]
    assert provider.calls[1]["messages"][-1] == {
        "role": "tool",
        "tool_call_id": "c1",
        "name": "message",
        "content": "sent",
    }


async def test_disabled_tool_is_refused_even_if_the_model_calls_it(redis: aioredis.Redis) -> None:
    provider = _script(
        LLMResponse(tool_calls=[ToolCallRequest("c1", "create_goal", {"title": "x"})]),
        LLMResponse(content="ok"),
    )
    loop = AgentLoop(RedisBus(redis), provider)
    key = "web:private"
    session = loop.sessions.get_or_create_transient(key, disabled_tools={"create_goal"})
    msg = InboundMessage(
        channel="web",
        sender_id="u",
        chat_id="private",
        content="hi",
        session_key_override=key,
        require_existing_session=True,
    )
    await loop.process_message(msg)

    assert "create_goal" not in str(provider.calls[0]["tools"])
    assert "not available" in provider.calls[1]["messages"][-1]["content"]
    assert "goals" not in session.metadata


async def test_read_and_search_sessions_see_stored_sessions(redis: aioredis.Redis) -> None:
    provider = _script(
        LLMResponse(content="first"),
        LLMResponse(tool_calls=[ToolCallRequest("c1", "search_sessions", {"query": "banana"})]),
        LLMResponse(tool_calls=[ToolCallRequest("c2", "read_session", {"session_key": "web:a"})]),
        LLMResponse(content="found"),
    )
    loop = AgentLoop(RedisBus(redis), provider)
    await loop.process_message(
        InboundMessage(channel="web", sender_id="u", chat_id="a", content="I like banana")
    )
    await loop.process_message(
        InboundMessage(channel="web", sender_id="u", chat_id="b", content="what do I like?")
    )

    tool_results = [m["content"] for m in provider.calls[3]["messages"] if m["role"] == "tool"]
    assert "web:a" in tool_results[0]
    assert "I like banana" in tool_results[1]


async def test_follow_up_is_injected_between_tool_rounds(redis_factory) -> None:  # type: ignore[no-untyped-def]
    client = FrontendClient(redis_factory())
    follow = InboundMessage(id="f1", channel="web", sender_id="u", chat_id="i", content="also this")
    steps = [
        LLMResponse(tool_calls=[ToolCallRequest("c1", "create_goal", {"title": "g"})]),
        LLMResponse(content="both handled"),
    ]

    async def handler(**_kw: object) -> LLMResponse:
        if len(steps) == 2:  # the user writes again while the turn runs
            await client.send(follow)
        return steps.pop(0)

    provider = ScriptedProvider(handler=handler)
    loop = AgentLoop(RedisBus(redis_factory()), provider, config=LoopConfig(read_block_ms=100))
    task = asyncio.create_task(loop.run())
    first = await client.send(
        InboundMessage(id="m1", channel="web", sender_id="u", chat_id="i", content="start")
    )
    got = await collect(client, "web", {first, "f1"})
    loop.stop()
    await asyncio.wait_for(task, 10)

    final = got["f1"][-1]
    assert final is got[first][-1]
    assert final.covers == ["m1", "f1"]
    assert len(provider.calls) == 2
    assert provider.calls[1]["messages"][-1] == {"role": "user", "content": "also this"}
    stored = await loop.sessions.read_session("web:i")
    assert [m["role"] for m in stored["messages"]] == [
        "user",
        "assistant",
        "tool",
        "user",
        "assistant",
    ]
    assert await client.redis.xlen(client.keys.inbound("web:i")) == 0


async def test_messages_that_arrive_before_the_final_answer_join_the_turn(redis_factory) -> None:  # type: ignore[no-untyped-def]
    """The last model boundary (nanobot#5792): the model answered without tools while two
    more messages arrived; both join, in order, a row each, and the model answers again
    with them in view; one terminal event covers the three messages."""
    client = FrontendClient(redis_factory())
    later = [
        InboundMessage(id=f"f{i}", channel="web", sender_id="u", chat_id="z", content=f"and {i}")
        for i in (1, 2)
    ]
    steps = [LLMResponse(content="first thoughts"), LLMResponse(content="all three handled")]

    async def handler(**_kw: object) -> LLMResponse:
        if len(steps) == 2:  # the user writes twice more while the model is answering
            for msg in later:
                await client.send(msg)
        return steps.pop(0)

    provider = ScriptedProvider(handler=handler)
    loop = AgentLoop(RedisBus(redis_factory()), provider, config=LoopConfig(read_block_ms=100))
    task = asyncio.create_task(loop.run())
    first = await client.send(
        InboundMessage(id="m1", channel="web", sender_id="u", chat_id="z", content="start")
    )
    got = await collect(client, "web", {first, "f1", "f2"})
    loop.stop()
    await asyncio.wait_for(task, 10)

    final = got[first][-1]
    assert final.content == "all three handled"
    assert final.covers == ["m1", "f1", "f2"]
    assert got["f2"][-1] is final
    assert provider.calls[1]["messages"][-3:] == [
        {"role": "assistant", "content": "first thoughts"},
        {"role": "user", "content": "and 1"},
        {"role": "user", "content": "and 2"},
    ]
    stored = await loop.sessions.read_session("web:z")
    assert [(m["role"], m["content"]) for m in stored["messages"]] == [
        ("user", "start"),
        ("assistant", "first thoughts"),
        ("user", "and 1"),
        ("user", "and 2"),
        ("assistant", "all three handled"),
    ]
    assert await client.redis.xlen(client.keys.inbound("web:z")) == 0


class _MetadataProbe:
    """A tool that reports the inbound metadata it is given."""

    name = "probe"
    description = "report metadata"
    parameters: dict[str, object] = {"type": "object", "properties": {}}

    async def execute(self, ctx, **_kw: object) -> str:  # type: ignore[no-untyped-def]
        return repr(sorted(ctx.metadata.items()))


async def test_metadata_reaches_tools_and_reply_without_reserved_keys(
    redis: aioredis.Redis,
) -> None:
    from worker.agent.tools import default_registry

    tools = default_registry()
    tools.register(_MetadataProbe())
    provider = _script(
        LLMResponse(tool_calls=[ToolCallRequest("c1", "probe", {})]), LLMResponse(content="ok")
    )
    loop = AgentLoop(RedisBus(redis), provider, tools=tools)
    meta = {"_runtime_control": "session_discard", "thread": "t-9", "lang": "en"}
    reply = await loop.process_message(
        InboundMessage(channel="web", sender_id="u", chat_id="m", content="hi", metadata=meta)
    )
    tool_result = provider.calls[1]["messages"][-1]["content"]
    assert tool_result == "[('lang', 'en'), ('thread', 't-9')]"
    assert reply is not None
    assert reply.metadata == {"lang": "en", "thread": "t-9", "worker": loop.worker_id}
