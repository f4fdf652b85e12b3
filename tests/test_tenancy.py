"""Many users, many frontends: scopes keep session tools and memory apart (and single-owner
mode joins them), a private session's disabled tools are named nowhere, its bad messages
leave no text behind, and folding in unified mode is the worker's decision."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import redis.asyncio as aioredis
from helpers import ScriptedProvider, dump_all

from bus_redis import FrontendClient, InboundMessage, Keys, RedisBus
from worker import AgentLoop, LoopConfig
from worker.agent.providers import LLMResponse, ToolCallRequest
from worker.runtime.outcomes import ScopeMismatchError

PIN = "my bank PIN is 4711"


def _snooping_provider() -> ScriptedProvider:
    """Answers plainly, except in bob's turn: there it searches and reads alice's session."""
    step = 0

    async def handler(**kw: Any) -> LLMResponse:
        nonlocal step
        if "snoop" not in json.dumps(kw["messages"]):
            return LLMResponse(content="noted")
        step += 1
        if step == 1:
            return LLMResponse(
                tool_calls=[ToolCallRequest("c1", "search_sessions", {"query": "4711"})]
            )
        if step == 2:
            return LLMResponse(
                tool_calls=[ToolCallRequest("c2", "read_session", {"session_key": "web:alice"})]
            )
        return LLMResponse(content="done")

    return ScriptedProvider(handler=handler)


@pytest.mark.parametrize("single_owner", [False, True])
async def test_session_tools_and_memory_stay_inside_a_scope(
    redis: aioredis.Redis, single_owner: bool
) -> None:
    provider = _snooping_provider()
    loop = AgentLoop(RedisBus(redis), provider, config=LoopConfig(single_owner=single_owner))
    alice_scope = loop.rt.scope_for("web", None, "alice")
    await loop.memory.write_memory("alice keeps her savings at Bank X", alice_scope)
    alice = InboundMessage(channel="web", sender_id="alice", chat_id="alice", content=PIN)
    bob = InboundMessage(channel="web", sender_id="bob", chat_id="bob", content="snoop around")
    await loop.process_message(alice)
    await loop.process_message(bob)

    assert len(provider.calls) == 4  # alice's turn; bob's: search, read, answer
    seen_by_bob = json.dumps([c["messages"] for c in provider.calls[1:]])
    if single_owner:  # nanobot's single-owner mode: one memory, every session readable
        assert PIN in seen_by_bob
        assert "Bank X" in seen_by_bob
    else:
        assert PIN not in seen_by_bob
        assert "Bank X" not in seen_by_bob
        assert "No stored session 'web:alice'" in seen_by_bob
        alice_prompt = json.dumps(provider.calls[0]["messages"])
        assert "Bank X" in alice_prompt  # her own memory does reach her


async def test_a_user_message_of_another_scope_is_refused_in_a_session(
    redis: aioredis.Redis,
) -> None:
    loop = AgentLoop(RedisBus(redis), ScriptedProvider(handler=_plain), config=LoopConfig())
    first = InboundMessage(channel="web", sender_id="alice", chat_id="group", content="hi")
    await loop.process_message(first)
    other = InboundMessage(channel="web", sender_id="mallory", chat_id="group", content="hi")
    with pytest.raises(ScopeMismatchError):  # over the wire: the error invalid_message
        await loop.process_message(other)
    vouched = [
        InboundMessage(channel="web", sender_id=s, chat_id="team", content="hi", scope="team-7")
        for s in ("alice", "bob")
    ]
    for msg in vouched:  # a frontend that vouches one scope for the group may mix senders
        reply = await loop.process_message(msg)
        assert reply is not None
        assert reply.type == "message"


async def _plain(**_kw: Any) -> LLMResponse:
    return LLMResponse(content="ok")


async def test_disabled_tools_are_named_nowhere_in_the_prompt(redis: aioredis.Redis) -> None:
    provider = ScriptedProvider(handler=_plain)
    loop = AgentLoop(RedisBus(redis), provider)
    loop.sessions.get_or_create_transient("web:p", disabled_tools={"create_goal", "read_session"})
    await loop.process_message(
        InboundMessage(channel="web", sender_id="u", chat_id="p", content="hi",
                       session_key_override="web:p", require_existing_session=True)
    )  # fmt: skip
    sent = json.dumps(provider.calls[0]["messages"]) + json.dumps(provider.calls[0]["tools"])
    assert "create_goal" not in sent
    assert "read_session" not in sent
    assert "update_goal" in sent  # the rest is offered


async def test_a_private_sessions_bad_messages_leave_no_text_in_redis(
    redis_factory, caplog: pytest.LogCaptureFixture
) -> None:  # type: ignore[no-untyped-def]
    """Too large, invalid and poison messages of a private session: answered and
    dead-lettered with sizes and a hash only; their text is in no key and no log."""

    async def handler(**kw: Any) -> LLMResponse:
        if "SECRET-POISON" in str(kw["messages"][-1]):
            raise RuntimeError("boom SECRET-POISON")
        return LLMResponse(content="ok")

    loop = AgentLoop(
        RedisBus(redis_factory()),
        ScriptedProvider(handler=handler),
        config=LoopConfig(read_block_ms=50, max_deliveries=2, max_payload_bytes=2048),
    )

    task = asyncio.create_task(loop.run())
    client = FrontendClient(redis_factory())
    key, _ = await client.open_transient("web", "p", session_key="web:p-private")
    private = {"session_key_override": key, "require_existing_session": True}
    try:
        msgs = [
            InboundMessage(channel="web", sender_id="u", chat_id="p", content="SECRET-LARGE " * 300, **private),
            InboundMessage(channel="web", sender_id="u", chat_id="p", content="SECRET-POISON", **private),
        ]  # fmt: skip
        codes = [(await client.ask(m, timeout_s=20)).code for m in msgs]
        invalid = {"v": 2, "channel": "web", "sender_id": "u", "chat_id": "p", "content": 5,
                   "media": "SECRET-INVALID", **private}  # fmt: skip
        await client.send_raw(key, json.dumps(invalid))
        last = await client.ask(
            InboundMessage(channel="web", sender_id="u", chat_id="p", content="fine", **private),
            timeout_s=20,
        )
    finally:
        loop.stop()
        await asyncio.wait_for(task, 10)

    assert codes == ["too_large", "dead_lettered"]
    assert last.content == "ok"
    everything = await dump_all(client.redis)
    logs = caplog.text
    for secret in ("SECRET-LARGE", "SECRET-POISON", "SECRET-INVALID"):
        assert secret not in everything
        assert secret not in logs
    dead = [json.loads(f["entry"]) for _, f in await client.redis.xrange(Keys().dead("web"))]
    assert len(dead) == 3
    assert all(d["private"] and "payload" not in d and len(d["sha256"]) == 64 for d in dead)


async def test_unified_mode_keys_duplicates_by_stream(redis: aioredis.Redis) -> None:
    """Two chats folded into one session may use the same client id: neither is taken for
    a re-send of the other."""
    provider = ScriptedProvider(handler=_echo)
    loop = AgentLoop(RedisBus(redis), provider, config=LoopConfig(unified_session=True))
    answers = []
    for chat in ("a", "b", "a"):
        msg = InboundMessage(
            id="1", channel="web", sender_id="u", chat_id=chat, content=f"from {chat}"
        )
        reply = await loop.process_message(msg)
        assert reply is not None
        answers.append((reply.content, reply.metadata.get("duplicate")))
    assert answers == [("re: from a", None), ("re: from b", None), ("re: from a", True)]
    assert len(provider.calls) == 2


async def _echo(**kw: Any) -> LLMResponse:
    return LLMResponse(content=f"re: {kw['messages'][-1]['content']}")


async def test_a_vouched_scope_name_never_equals_a_senders_default_scope(
    redis: aioredis.Redis,
) -> None:
    provider = _snooping_provider()
    loop = AgentLoop(RedisBus(redis), provider)
    await loop.process_message(
        InboundMessage(channel="web", sender_id="alice", chat_id="alice", content=PIN)
    )
    mallory = InboundMessage(
        channel="web",
        sender_id="mallory",
        chat_id="m",
        content="snoop around",
        scope="sender:alice",
    )
    await loop.process_message(mallory)
    assert PIN not in json.dumps([c["messages"] for c in provider.calls[1:]])
