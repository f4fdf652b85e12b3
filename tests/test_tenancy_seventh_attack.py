"""Tenancy attacked a seventh time: a hostile frontend with a valid connection for one
channel, and a hostile user of a channel, each trying to reach another user's data.
Each test fails on the code it was written against for the reason its docstring gives.
No sleeps synchronize anything: every wait is on a condition with a deadline.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import redis.asyncio as aioredis
from helpers import ScriptedProvider
from replies import collect, until
from test_private_leaks import alices_private

from bus_redis import FrontendClient, InboundMessage, Keys
from worker.agent.providers import LLMResponse

K = Keys()
SECRET = "ALICE-SECRET-4711"


def _said(provider: ScriptedProvider) -> list[str]:
    """Every prompt the provider was sent, as text."""
    return [json.dumps(call["messages"]) for call in provider.calls]


async def _noted(**_kw: Any) -> LLMResponse:
    return LLMResponse(content="noted")


async def test_an_opening_that_vouches_no_scope_does_not_wipe_another_users_private_session(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """SECURITY.md: a frontend may "open a private session on one of its own chat keys
    (messages of another scope for that key are then refused until it ends, and so is an
    opening of that key under another scope: it takes nothing of the live session,
    history included)"; README: a message without ``scope`` is the sender's alone.

    ``_open_transient`` refuses another scope's opening only when the opening names a
    scope (``wanted is not None``). An opening without one (the default of
    ``FrontendClient.open_transient``) passes, and when it asks for other disabled tools
    ``get_or_create_transient`` (another policy) replaces alice's live private session
    with an empty one: her conversation is gone, and the next sender of the key (bob)
    takes the key's scope, so alice's own messages are refused from then on."""
    provider = ScriptedProvider(handler=_noted)
    make_loop(provider)
    client = FrontendClient(redis)
    key, private = await alices_private(client, f"remember {SECRET}")

    # bob's side of the same chat opens the key without vouching a scope (his sender's)
    _, again = await client.open_transient(
        "web", "42", session_key=key, disabled_tools=["create_goal"]
    )
    await collect(client, "web", {again})

    alice_again = InboundMessage(
        channel="web", sender_id="alice", chat_id="42", scope="alice",
        content="what did I ask you to remember?", id="a2", **private,
    )  # fmt: skip
    answer = await client.ask(alice_again, timeout_s=10)
    assert answer.type == "message", (
        f"alice's own private session was taken from her: {answer.code} {answer.content!r}"
    )
    prompt = next(p for p in _said(provider) if "what did I ask you to remember?" in p)
    assert SECRET in prompt, "alice's private conversation was wiped by another opening"


PRIVATE_TEXT = "PRIVATE-ONLY-8812"


async def test_a_private_message_never_joins_a_durable_turn_of_its_key(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """README: "``require_existing_session`` is met only by a live (transient) session:
    stored history is never a fallback" (a message sent with it and no private session
    open gets ``session_not_active``); SECURITY.md: private sessions keep their text in
    the owning worker's memory only, nothing of it in session hashes.

    ``FollowUpPuller._joinable`` checks the key, the scope and the follow-up mode, not
    ``require_existing_session``: a private message (its session ended a moment ago, or
    never opened on this worker) that arrives while a durable turn of the same key runs
    joins that turn, is answered in it and is committed into the stored history."""
    release = asyncio.Event()

    async def handler(**kw: Any) -> LLMResponse:
        if "durable question" in json.dumps(kw["messages"]) and not release.is_set():
            await release.wait()
        return LLMResponse(content="noted")

    provider = ScriptedProvider(handler=handler)
    make_loop(provider)
    client = FrontendClient(redis)
    durable = InboundMessage(
        channel="web", sender_id="alice", chat_id="42", content="durable question", id="d1"
    )
    await client.send(durable)
    await until(lambda: provider.started.is_set())
    private = InboundMessage(
        channel="web", sender_id="alice", chat_id="42", content=PRIVATE_TEXT, id="p1",
        session_key_override="web:42", require_existing_session=True,
    )  # fmt: skip
    await client.send(private)
    release.set()
    got = await collect(client, "web", {"d1", "p1"})
    terminal = [e for e in got["p1"] if e.is_terminal]
    stored = json.dumps(await redis.hgetall(K.session("web:42")))
    assert PRIVATE_TEXT not in stored, "a private message was committed into stored history"
    assert terminal[-1].code == "session_not_active", terminal[-1]
