"""A hostile review of private sessions and tenancy: each test shows a way one user's
text reached another user's session (a firing queued behind a delete; a channel named
``system``). Each failed on the commit it was written against (88bf850)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import redis.asyncio as aioredis
from helpers import ScriptedProvider
from replies import collect

from bus_redis import FrontendClient, InboundMessage, Keys, RedisBus
from worker import AgentLoop, LoopConfig
from worker.agent.providers import LLMResponse, ToolCallRequest

K = Keys()
ALICE_CRON = "ALICE-CRON-SECRET: call the bank about account 4711"


def _said(provider: ScriptedProvider) -> list[str]:
    return [json.dumps(call["messages"]) for call in provider.calls]


async def test_a_firing_queued_behind_a_delete_never_reaches_the_next_users_session(  # type: ignore[no-untyped-def]
    redis_factory, make_loop
) -> None:
    """Defect: a schedule's firing that was published into a session's stream after a
    ``delete`` marker (the marker not reached yet: no worker up, or the running turn
    missed the pub/sub) survives the delete. ``delete.lua`` removes the session and its
    schedules, but the firing entry already queued behind the marker is then run in
    whatever session starts next under that key -- even one of another scope, because a
    worker-made message skips ``scopes.check_scope``. So alice's schedule text (hers: she
    deleted the conversation, and "Deleting a session deletes its schedules") is put
    into bob's prompt and bob's stored history.

    Why it matters: "Session tools and long-term memory never cross scopes" (SPEC 9) and
    README's "messages after the marker start a new, empty session". Expected: a firing of
    a schedule that no longer exists (or of a session generation / scope other than the
    one that added it) is answered ``session_not_active`` (or dropped) and never enters
    the new session."""

    async def model(**kw: Any) -> LLMResponse:
        last = kw["messages"][-1]
        if last["role"] == "user" and last["content"] == "remind me":
            add = {"action": "add", "every_seconds": 3600, "message": ALICE_CRON}
            return LLMResponse(tool_calls=[ToolCallRequest("c1", "cron", add)])
        return LLMResponse(content="ok")

    provider = ScriptedProvider(handler=model)
    redis = redis_factory()
    client = FrontendClient(redis)
    first = AgentLoop(RedisBus(redis_factory()), provider, config=LoopConfig(read_block_ms=50))
    task = asyncio.create_task(first.run())
    try:
        alice = InboundMessage(
            id="a1", channel="web", chat_id="room", sender_id="alice", scope="alice",
            content="remind me",
        )  # fmt: skip
        await client.send(alice)
        await collect(client, "web", {"a1"}, timeout_s=10)
    finally:
        first.stop()
        await asyncio.wait_for(task, 10)
    [sid] = await redis.smembers(K.crons("web:room"))

    # no worker runs now: alice deletes her conversation; bob starts one on the key;
    # then her schedule comes due (a worker's sweep fires it into the stream)
    await client.delete("web:room")
    bob = InboundMessage(
        id="b1", channel="web", chat_id="room", sender_id="bob", scope="bob",
        content="hello, I am new here",
    )  # fmt: skip
    await client.send(bob)
    due = int(time.time() * 1000) - 1
    await redis.zadd(K.cron_due("web"), {sid: due})
    firer = AgentLoop(RedisBus(redis_factory()), ScriptedProvider([]))
    try:
        assert await firer.schedules.fire(channel="web", sid=sid, due_ms=due)
    finally:
        await firer.jobs.aclose()

    before = len(provider.calls)
    make_loop(provider)
    firing = f"cron:{sid}:{due}"
    got = await collect(client, "web", {"b1", firing}, timeout_s=15)
    [answer] = [e for e in got[firing] if e.is_terminal]

    bobs_prompts = _said(provider)[before:]
    stored = json.dumps(await redis.hgetall(K.session("web:room")))
    assert not any("ALICE-CRON-SECRET" in p for p in bobs_prompts), (
        "alice's deleted schedule was run in bob's session"
    )
    assert "ALICE-CRON-SECRET" not in stored
    assert answer.type == "error"


async def test_a_user_message_of_another_scope_is_refused_on_a_channel_named_system(
    redis: aioredis.Redis,
) -> None:
    """Defect: ``InboundMessage.is_user_input`` is ``channel != "system"`` when the message
    names no ``input_role`` (nanobot's internal channel), and ``scopes.check_scope`` only refuses
    a scope change for user input. But ``system`` is an ordinary channel name here (README:
    1-64 of ``A-Z a-z 0-9 _ -``, only ``unified`` is reserved; it is even one of the test
    channels), and a frontend's plain user messages there are taken for system messages:
    the scope guard is off for the whole channel. Bob's message on alice's chat runs
    inside alice's session, with alice's long-term memory in his prompt and her history.

    Why it matters: README "a later user message asking for another scope gets
    ``invalid_message``"; SPEC 9 "Session tools and long-term memory never cross scopes".
    Expected: as on any other channel, bob's message is refused (ScopeMismatchError in
    process; ``invalid_message`` on the wire) and his prompt never holds alice's memory;
    a message is a system message only by its ``input_role`` (or ``system`` is reserved)."""
    from worker.runtime.outcomes import ScopeMismatchError

    async def plain(**_kw: Any) -> LLMResponse:
        return LLMResponse(content="ok")

    provider = ScriptedProvider(handler=plain)
    loop = AgentLoop(RedisBus(redis), provider, config=LoopConfig())
    alice_scope = loop.rt.scope_for("system", "alice", "alice")
    await loop.memory.write_memory("ALICE-MEMORY: savings at Bank X, PIN 4711", alice_scope)
    alice = InboundMessage(
        channel="system", sender_id="alice", chat_id="ops", scope="alice", content="hi"
    )
    await loop.process_message(alice)
    assert "ALICE-MEMORY" in _said(provider)[0]  # her own memory reaches her

    bob = InboundMessage(
        channel="system", sender_id="bob", chat_id="ops", scope="bob", content="what do you know?"
    )
    refused = False
    try:
        await loop.process_message(bob)
    except ScopeMismatchError:
        refused = True
    bobs = [p for p in _said(provider) if "what do you know?" in p]
    assert not any("ALICE-MEMORY" in p for p in bobs), "bob's turn was given alice's memory"
    assert refused
