"""Private sessions and deletion as a hostile reviewer attacked them: a live private
session reopened under another scope, a provider error quoting a private message into the
log, a processed private message left in its stream's bytes, a unified chat's tool journal
outliving its delete. Each test failed on the code before its fix."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import redis.asyncio as aioredis
from helpers import ScriptedProvider, dump_all
from replies import collect, open_private, until

from bus_redis import FrontendClient, InboundMessage, Keys
from worker.agent.providers import LLMResponse, ToolCallRequest

K = Keys()


def _said(provider: ScriptedProvider) -> list[str]:
    """Every prompt the provider was sent, as text."""
    return [json.dumps(call["messages"]) for call in provider.calls]


async def alices_private(client: FrontendClient, text: str) -> tuple[str, dict[str, Any]]:
    """Alice's private session on ``web:42-private`` (her scope vouched), told ``text``;
    its key and the fields every message of it carries."""
    key = "web:42-private"
    _, opened = await client.open_transient("web", "42", session_key=key, scope="alice")
    await collect(client, "web", {opened})
    private = {"session_key_override": key, "require_existing_session": True}
    alice = InboundMessage(
        channel="web", sender_id="alice", chat_id="42", scope="alice",
        content=text, id="a1", **private,
    )  # fmt: skip
    assert (await client.ask(alice, timeout_s=10)).type == "message"
    return key, private


async def test_reopening_a_live_private_session_under_another_scope_does_not_hand_it_over(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """SECURITY.md: a frontend may "open a private session on one of its own chat keys
    (messages of another scope for that key are then refused until it ends)"; "a session's
    scope is fixed by its first message". A second opening of the same key (README's own
    example keys it by chat: web:42-private, shared by every member of chat 42) that
    vouches another scope gets the live session back with its history
    (``get_or_create_transient`` returns the cached one: same policy) and
    ``_open_transient`` overwrites its scope: bob's messages are then accepted and his
    turn runs on alice's private conversation (the model is sent her text), while alice's
    own messages are refused as another scope."""

    async def answer(**kw: Any) -> LLMResponse:
        return LLMResponse(content="noted")

    provider = ScriptedProvider(handler=answer)
    make_loop(provider)
    client = FrontendClient(redis)
    key, private = await alices_private(client, "my PIN is ALICE-SECRET-4711")

    # bob, in the same chat, opens "his" private session: the frontend vouches his scope
    _, again = await client.open_transient("web", "42", session_key=key, scope="bob")
    await collect(client, "web", {again})
    bob = InboundMessage(
        channel="web", sender_id="bob", chat_id="42", scope="bob",
        content="what did we talk about?", id="b1", **private,
    )  # fmt: skip
    await client.ask(bob, timeout_s=10)

    bobs_prompts = [p for p in _said(provider) if "what did we talk about?" in p]
    assert not any("ALICE-SECRET-4711" in p for p in bobs_prompts), (
        "bob's turn was run on alice's private history"
    )


async def test_a_private_sessions_text_quoted_by_a_provider_error_is_not_logged(  # type: ignore[no-untyped-def]
    real_redis, spawn_workers, fake_llm
) -> None:
    """SECURITY.md: "Message text of private sessions is never logged"; README: a private
    session's log line carries sizes only. A model server that quotes the request in its
    error (the fake's ``status:503`` answers "scripted <the user text>", as proxies and
    validators do) gets its message logged at WARNING by the provider's retry line
    (``openai_provider.chat_with_retry``), which does not know the session is private:
    ``TurnExecution`` hides a private turn's ProviderError text, the retry log does not."""
    (w0,) = spawn_workers(1)
    client = FrontendClient(real_redis)
    key, opened = await client.open_transient("web", "lg", session_key="web:lg-private")
    await collect(client, "web", {opened}, timeout_s=20)
    msg = InboundMessage(
        channel="web", sender_id="u", chat_id="lg", id="m", content="PIN-SECRET-5501 status:503",
        session_key_override=key, require_existing_session=True,
    )  # fmt: skip
    reply = await client.ask(msg, timeout_s=20)
    assert reply.type == "message"  # answered after one retry
    assert "provider retry" in w0.log()  # the retry was logged ...
    assert "PIN-SECRET-5501" not in w0.log()  # ... with the private text it quoted


@pytest.mark.parametrize("redis_factory", ["real"], indirect=True)  # DUMP: Redis' own bytes
async def test_a_processed_private_message_is_not_kept_in_the_inbound_streams_bytes(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """ARCHITECTURE: a private session's Redis footprint is content-free but for "until
    processed, the inbound entry", and "XDEL only marks an entry deleted while its
    listpack node has live entries (the bytes stay in memory and in RDB snapshots)",
    which is why its event stream is rewritten (compact.lua). Its inbound stream is not:
    commit.lua XDELs a processed private message while a later one waits in the same
    node, so its text stays in Redis' memory and in any snapshot (DUMP is what an RDB
    holds of the key) for as long as the session has messages queued."""
    first_in, second_in = asyncio.Event(), asyncio.Event()
    first_go, second_go = asyncio.Event(), asyncio.Event()

    async def answer(**kw: Any) -> LLMResponse:
        last = json.dumps(kw["messages"][-1])
        if "INBOUND-SECRET-9090" in last:
            first_in.set()
            await first_go.wait()
        elif "second" in last:
            second_in.set()
            await second_go.wait()
        return LLMResponse(content="ok")

    make_loop(ScriptedProvider(handler=answer), followup_mode="queue")
    client = FrontendClient(redis)
    key = await open_private(client, "ib")
    private = {"session_key_override": key, "require_existing_session": True}
    m1 = InboundMessage(
        channel="web", sender_id="u", chat_id="ib", id="m1",
        content="INBOUND-SECRET-9090", **private,
    )  # fmt: skip
    m2 = InboundMessage(
        channel="web", sender_id="u", chat_id="ib", id="m2", content="second", **private
    )
    await client.send(m1)
    await asyncio.wait_for(first_in.wait(), 10)
    await client.send(m2)  # queued behind m1, in the same listpack node
    first_go.set()
    await asyncio.wait_for(second_in.wait(), 10)  # m1 answered and committed (XDEL'd)
    try:
        assert await redis.xlen(K.inbound(key)) == 1  # only m2 is left, as far as XLEN says
        dumped = await redis.dump(K.inbound(key))
        assert b"INBOUND-SECRET-9090" not in dumped, "m1's text is still in the stream's bytes"
    finally:
        second_go.set()


async def _journal_left_by_a_delete(redis: aioredis.Redis, make_loop, *, unified: bool) -> str:  # type: ignore[no-untyped-def]
    """A durable turn of web:j calls the message tool (journaled), then fails before its
    commit (as a worker killed there would leave it); a delete marker is queued meanwhile
    (its pub/sub message unheard: at most once). The entry is then cancelled by the
    marker and the delete applied. Returns every key and value left."""

    reached, marked = asyncio.Event(), asyncio.Event()
    failed: list[bool] = []

    async def answer(**kw: Any) -> LLMResponse:
        last = kw["messages"][-1]
        if last.get("role") == "user" and "do it" in json.dumps(last):
            call = ToolCallRequest("c1", "message", {"content": "JOURNAL-SECRET-31"})
            return LLMResponse(tool_calls=[call])
        if last.get("role") == "tool" and not failed:
            failed.append(True)
            reached.set()
            await marked.wait()
            raise RuntimeError("the model connection broke")
        return LLMResponse(content="ok")

    make_loop(ScriptedProvider(handler=answer), unified_session=unified)
    client = FrontendClient(redis)
    key = "web:j"
    msg = InboundMessage(channel="web", sender_id="u", chat_id="j", id="e1", content="do it")
    await client.send(msg)
    await asyncio.wait_for(reached.wait(), 10)
    async with redis.pipeline(transaction=True) as pipe:
        client.queue_control(pipe, "delete", key)
        await pipe.execute()
    marked.set()
    got = await collect(client, "web", {"e1"}, timeout_s=15)
    assert [e.code for e in got["e1"] if e.is_terminal] == ["cancelled"]

    async def applied() -> bool:
        return await redis.xlen(K.inbound(key)) == 0

    await until(applied, timeout_s=15)
    return await dump_all(redis)


async def test_a_delete_in_unified_mode_leaves_no_tool_journal_of_the_chat(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """README: delete "deletes a durable session's stored history, its index entries and
    its events"; delete.lua takes "its tool journal" with it. In unified mode the chat's
    turns run under unified:default's lease, so their journal is journal(unified:default)
    (field entry "web:j|<id>"), while delete.lua is given journal(web:j): the crashed
    turn's journaled rows (the message tool's text) stay for a day (JOURNAL_TTL_MS) after
    the chat was deleted. (Per-session mode, the same steps leave nothing.)"""
    left = await _journal_left_by_a_delete(redis, make_loop, unified=True)
    assert "JOURNAL-SECRET-31" not in left, "the crashed turn's tool journal outlived the delete"


# --- from a second reading of the fixes ------------------------------------------------
_MAX_ID = "18446744073709551615-18446744073709551615"


async def test_shedding_a_private_stream_with_an_entry_at_the_maximal_id_keeps_the_commit(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """commit.lua's new ``shed_deleted`` (private sessions, 'p') takes its id floor with
    ``XADD key * ...``. A frontend may XADD an entry at the maximal id (the scripts guard
    every other look for it: ``entry_after``, test_an_entry_at_the_maximal_id_breaks_no_look);
    when such an entry waits behind a processed private message, ``XADD *`` raises
    ("exhausted the last possible ID") in the middle of commit.lua, after the processed
    entry was XDEL'd and before the terminal event is written: the answer is lost (the
    commit is then idempotent: its entry is gone, nothing is written again)."""
    first_in, first_go = asyncio.Event(), asyncio.Event()

    async def answer(**kw: Any) -> LLMResponse:
        if "FIRST" in json.dumps(kw["messages"][-1]):
            first_in.set()
            await first_go.wait()
        return LLMResponse(content="answered")

    make_loop(ScriptedProvider(handler=answer), followup_mode="queue")
    client = FrontendClient(redis)
    key = await open_private(client, "mx")
    m1 = InboundMessage(
        channel="web", sender_id="u", chat_id="mx", id="m1", content="FIRST",
        session_key_override=key, require_existing_session=True,
    )  # fmt: skip
    await client.send(m1)
    await asyncio.wait_for(first_in.wait(), 10)
    # a frontend's entry at the maximal id, queued behind m1 (no payload: not a late
    # message the commit would wait for)
    await redis.xadd(K.inbound(key), {"junk": "1"}, id=_MAX_ID)
    first_go.set()
    got = await collect(client, "web", {"m1"}, timeout_s=15)
    assert [(e.type, e.content) for e in got["m1"] if e.is_terminal] == [("message", "answered")]


async def test_deleting_a_unified_chat_keeps_the_journal_of_a_chat_whose_key_extends_it(
    redis: aioredis.Redis,
) -> None:
    """``JournalStore.drop_of`` (new: a unified chat's delete/new/discard drops its crashed
    turn's tool journal) matches the journal's entry ``"<session>|<entry id>"`` by prefix
    ``f"{session}|"``. A chat id may hold ``|`` (``chat_id`` is any non-empty text), so
    deleting chat ``web:a`` drops the journal of chat ``web:a|b``'s crashed turn: its
    re-run no longer replays the tool calls it already made (a message sent twice)."""
    from bus_redis import RedisBus
    from bus_redis.journal import JournalStore
    from session_store import UNIFIED_SESSION_KEY

    bus = RedisBus(redis)
    token = "tok|w1"
    await redis.set(K.lease(UNIFIED_SESSION_KEY), token, px=60_000)
    journal = JournalStore(bus)
    entry = "web:a|b|1700000000000-0"  # chat "a|b"'s crashed turn: its entry of web:a|b
    assert await journal.append(UNIFIED_SESSION_KEY, token, entry, ['{"role":"tool"}']) == 1
    await journal.drop_of(UNIFIED_SESSION_KEY, token, "web:a")  # chat "a" is deleted
    assert await journal.read(UNIFIED_SESSION_KEY, entry) == ['{"role":"tool"}'], (
        "deleting web:a dropped the tool journal of web:a|b"
    )
