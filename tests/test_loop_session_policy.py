"""The user's reference test (nanobot tests/agent/test_loop_session_policy.py), ported to
our API. Each body runs on fakeredis and on a real redis-server."""

from __future__ import annotations

import asyncio
from unittest.mock import AsyncMock

import pytest
import redis.asyncio as aioredis
from helpers import ScriptedProvider, dump_all

from bus_redis import FrontendClient, InboundMessage, RedisBus
from session_store import UNIFIED_SESSION_KEY
from worker import AgentLoop
from worker.agent.providers import LLMResponse, ToolCallRequest

DURABLE_TOOLS = {"create_goal", "update_goal", "spawn", "cron"}


def _message(key: str, content: str) -> InboundMessage:
    return InboundMessage(
        channel="websocket",
        sender_id="user",
        chat_id=key.removeprefix("websocket:"),
        content=content,
        session_key_override=key,
        require_existing_session=True,
    )


def _call(name: str, arguments: dict[str, object]) -> ToolCallRequest:
    return ToolCallRequest(id=f"call-{name}", name=name, arguments=arguments)


def _loop(redis: aioredis.Redis, provider: ScriptedProvider, **kwargs: object) -> AgentLoop:
    return AgentLoop(RedisBus(redis), provider, model="test-model", **kwargs)  # type: ignore[arg-type]


async def test_transient_session_keeps_history_without_persisting_or_durable_tools(
    redis: aioredis.Redis,
) -> None:
    provider = ScriptedProvider(["first answer", "second answer"])
    loop = _loop(redis, provider)
    await loop.memory.write_memory("private durable memory")
    loop.consolidator.maybe_consolidate_by_tokens = AsyncMock()  # type: ignore[method-assign]
    key = "websocket:transient-test"
    loop.sessions.get_or_create_transient(key, disabled_tools=DURABLE_TOOLS)

    await loop.process_message(_message(key, "first question"))
    await loop.process_message(_message(key, "second question"))

    calls = provider.calls
    assert "private durable memory" not in str(calls[0]["messages"])
    tool_names = {item["function"]["name"] for item in calls[0]["tools"]}
    assert "read_session" in tool_names
    assert DURABLE_TOOLS.isdisjoint(tool_names)
    assert "first answer" in str(calls[1]["messages"])
    session = loop.sessions.get_cached(key)
    assert session is not None
    assert [m["role"] for m in session.messages] == ["user", "assistant", "user", "assistant"]
    assert await loop.sessions.read_session(key) is None
    loop.consolidator.maybe_consolidate_by_tokens.assert_not_awaited()
    everything = await dump_all(redis)
    for text in ("first question", "first answer", "second question", "second answer"):
        assert text not in everything


async def test_durable_session_gets_memory_tools_persistence_and_consolidation(
    redis: aioredis.Redis,
) -> None:
    """The contrast case: the same turn on a durable session does all the transient one must not."""
    provider = ScriptedProvider(["durable answer"])
    loop = _loop(redis, provider)
    await loop.memory.write_memory("shared durable memory", "websocket/sender:user")
    loop.consolidator.maybe_consolidate_by_tokens = AsyncMock()  # type: ignore[method-assign]
    msg = InboundMessage(
        channel="websocket", sender_id="user", chat_id="durable", content="durable question"
    )

    await loop.process_message(msg)

    assert "shared durable memory" in str(provider.calls[0]["messages"])
    assert {t["function"]["name"] for t in provider.calls[0]["tools"]} >= DURABLE_TOOLS
    stored = await loop.sessions.read_session("websocket:durable")
    assert stored is not None
    assert [m["content"] for m in stored["messages"]] == ["durable question", "durable answer"]
    loop.consolidator.maybe_consolidate_by_tokens.assert_awaited_once()


async def test_a_transient_session_never_gets_spawn_or_cron_even_if_it_disables_nothing(
    redis: aioredis.Redis,
) -> None:
    """spawn and cron are durable-only: a subagent's task and a schedule live in Redis and
    outlive the private session, so no private session is offered them, names them in its
    prompt, or may call them."""
    answers = [LLMResponse(tool_calls=[_call("cron", {"action": "list"})]), LLMResponse("done")]

    async def script(**_: object) -> LLMResponse:
        return answers.pop(0)

    provider = ScriptedProvider(handler=script)
    loop = _loop(redis, provider)
    key = "websocket:transient-open"
    loop.sessions.get_or_create_transient(key)  # disables nothing

    await loop.process_message(_message(key, "schedule something"))

    offered = {t["function"]["name"] for t in provider.calls[0]["tools"]}
    assert {"spawn", "cron"}.isdisjoint(offered)
    assert "create_goal" in offered
    system = provider.calls[0]["messages"][0]["content"]
    assert "spawn" not in system
    assert "cron" not in system
    session = loop.sessions.get_cached(key)
    assert session is not None
    [result] = [m for m in session.messages if m["role"] == "tool"]
    assert result["content"] == "Error: tool 'cron' is not available in this session"


async def test_transient_session_stays_outside_unified_session(redis: aioredis.Redis) -> None:
    provider = ScriptedProvider(["private answer"])
    loop = _loop(redis, provider, unified_session=True)
    durable = await loop.sessions.get_or_create(UNIFIED_SESSION_KEY)
    durable.add_message("user", "durable question")
    await loop.sessions.save(durable)
    key = "websocket:transient-unified"
    transient = loop.sessions.get_or_create_transient(key)

    await loop.process_message(_message(key, "private question"))

    assert [m["content"] for m in transient.messages] == ["private question", "private answer"]
    assert [m["content"] for m in durable.messages] == ["durable question"]
    stored = await loop.sessions.read_session(UNIFIED_SESSION_KEY)
    assert stored is not None
    assert [m["content"] for m in stored["messages"]] == ["durable question"]
    assert await loop.sessions.read_session(key) is None


async def test_missing_required_session_cannot_fall_back_to_storage(redis: aioredis.Redis) -> None:
    provider = ScriptedProvider([])
    loop = _loop(redis, provider)
    key = "websocket:transient-stale"
    stale = await loop.sessions.get_or_create(key)  # a durable copy exists in storage
    stale.add_message("user", "old durable text")
    await loop.sessions.save(stale)
    loop.sessions.get_or_create_transient(key)
    loop.sessions.invalidate(key)

    with pytest.raises(RuntimeError, match="required session is not active"):
        await loop.process_message(_message(key, "stale private message"))

    assert provider.calls == []
    stored = await loop.sessions.read_session(key)
    assert stored is not None
    assert "stale private message" not in str(stored)
    assert "stale private message" not in await dump_all(redis)


async def test_session_discard_control_cancels_active_turn(
    redis: aioredis.Redis, redis_factory
) -> None:  # type: ignore[no-untyped-def]
    async def block_provider(**_kwargs: object) -> LLMResponse:
        await asyncio.Event().wait()
        raise AssertionError("provider blocker unexpectedly released")

    provider = ScriptedProvider(handler=block_provider)
    loop = _loop(redis, provider)
    frontend = FrontendClient(redis_factory())
    key = "websocket:transient-cancelled"
    loop.sessions.get_or_create_transient(key, disabled_tools=DURABLE_TOOLS)
    run_task = asyncio.create_task(loop.run())
    await frontend.send(_message(key, "private"))
    await asyncio.wait_for(provider.started.wait(), timeout=2)
    active_task = loop.active_tasks[key]

    assert await frontend.discard(key) >= 1  # over the Redis control channel

    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(active_task, timeout=2)
    assert loop.sessions.get_cached(key) is None

    loop.stop()
    await frontend.send(_message(key, "wake"))
    await asyncio.wait_for(run_task, timeout=2)
