"""A hostile review of the cron remove's undo (1574c7b) and ``new`` folding in parts
(9835331): each test failed on b0fec1c (on both backends)."""

from __future__ import annotations

import asyncio
from typing import Any

from helpers import ScriptedProvider
from replies import collect

from bus_redis import FrontendClient, InboundMessage, Keys
from session_store.memory import MemoryStore
from worker.agent.providers import LLMResponse, ToolCallRequest

K = Keys()


def _last(kw: dict[str, Any]) -> dict[str, Any]:
    return kw["messages"][-1]


async def _cut_turn(redis, make_loop, model, chat: str, **config: Any) -> None:  # type: ignore[no-untyped-def]
    """A first turn ("first") is committed; the second ("go") is discarded while its
    model holds; returns once its cancelled answer is out (its undos have run)."""
    make_loop(ScriptedProvider(handler=model), **config)
    client = FrontendClient(redis)
    msg = {"channel": "web", "chat_id": chat, "sender_id": "u"}
    await client.send(InboundMessage(id="t1", content="first", **msg))
    got = await collect(client, "web", {"t1"}, timeout_s=10)
    assert [e.type for e in got["t1"] if e.is_terminal] == ["message"]
    await client.send(InboundMessage(id="t2", content="go", **msg))
    await asyncio.wait_for(model.holding.wait(), 10)
    await client.discard(f"web:{chat}")
    got = await collect(client, "web", {"t2"}, timeout_s=10)
    assert [e.code for e in got["t2"] if e.is_terminal] == ["cancelled"]


async def test_a_discarded_turn_that_added_then_removed_a_schedule_leaves_none(  # type: ignore[no-untyped-def]
    redis, make_loop
) -> None:
    """One turn adds a schedule (round 1), removes it (round 2), and is discarded. The
    undos run in the order the effects were made, not backwards: the add's undo finds
    nothing to remove, then the remove's undo adds the schedule back. A discarded turn
    leaves a live, firing schedule that no kept history mentions."""
    holding, release = asyncio.Event(), asyncio.Event()
    sid: list[str] = []

    async def model(**kw: Any) -> LLMResponse:
        last = _last(kw)
        if last["role"] == "user" and last["content"] == "go":
            args = {"action": "add", "every_seconds": 3600, "message": "x"}
            return LLMResponse(tool_calls=[ToolCallRequest("c1", "cron", args)])
        if last["role"] == "tool" and str(last["content"]).startswith("Scheduled"):
            sid.append(str(last["content"]).split()[1].rstrip(":"))
            args = {"action": "remove", "id": sid[0]}
            return LLMResponse(tool_calls=[ToolCallRequest("c2", "cron", args)])
        if last["role"] == "tool" and str(last["content"]).startswith("Removed"):
            holding.set()
            await release.wait()
        return LLMResponse(content="done")

    model.holding = holding  # type: ignore[attr-defined]
    try:
        await _cut_turn(redis, make_loop, model, "ar")
        assert sid
        assert await redis.smembers(K.crons("web:ar")) == set()  # fails: {sid} is back
        assert await redis.hlen(K.cron_defs("web")) == 0
    finally:
        release.set()


async def test_a_discarded_turn_that_removed_then_added_at_the_limit_gives_back_the_first(  # type: ignore[no-untyped-def]
    redis, make_loop
) -> None:
    """AGENT_CRON_MAX_PER_SESSION=1: the session holds schedule A; a turn removes A and
    adds B (replacing it), then is discarded. The remove's undo runs first, finds the
    session full (B), and gives up; then the add's undo removes B. The turn never
    happened, yet the session has lost A."""
    holding, release = asyncio.Event(), asyncio.Event()
    first: list[str] = []

    async def model(**kw: Any) -> LLMResponse:
        last = _last(kw)
        if last["role"] == "user" and last["content"] == "first":
            args = {"action": "add", "every_seconds": 3600, "message": "A"}
            return LLMResponse(tool_calls=[ToolCallRequest("c0", "cron", args)])
        if last["role"] == "user" and last["content"] == "go":
            args = {"action": "remove", "id": first[0]}
            return LLMResponse(tool_calls=[ToolCallRequest("c1", "cron", args)])
        if last["role"] == "tool" and str(last["content"]).startswith("Removed"):
            args = {"action": "add", "every_seconds": 7200, "message": "B"}
            return LLMResponse(tool_calls=[ToolCallRequest("c2", "cron", args)])
        if last["role"] == "tool" and str(last["content"]).startswith("Scheduled"):
            if not first:
                first.append(str(last["content"]).split()[1].rstrip(":"))
                return LLMResponse(content="done")
            holding.set()
            await release.wait()
        return LLMResponse(content="done")

    model.holding = holding  # type: ignore[attr-defined]
    try:
        await _cut_turn(redis, make_loop, model, "lim", cron_max_per_session=1)
        assert first
        assert await redis.smembers(K.crons("web:lim")) == {first[0]}  # fails: set()
    finally:
        release.set()


def _msg(chat: str, text: str) -> InboundMessage:
    return InboundMessage(channel="web", sender_id="u", chat_id=chat, content=text, scope="team")


async def test_new_sends_a_last_row_longer_than_a_part_uncut_and_archives_it_raw(  # type: ignore[no-untyped-def]
    redis_factory, make_loop
) -> None:
    """The model wrote a long answer (longer than a part, and than its own context when
    summarising); then `new`. The parts before it are folded, but the last part is that
    one row alone: `_part` returns the rows list itself, `part is rows`, so the transcript
    is sent without the cap the jobs (and every other part) apply; the request is too long,
    and the answer goes to the archive as raw text instead of into memory (cut, besides,
    to RAW_MAX_BYTES) — the very failure 9835331 says it fixes."""
    summaries: list[int] = []

    async def answer(**kw: Any) -> LLMResponse:
        messages = kw["messages"]
        if "Summarise" in str(messages[0]["content"]):
            text = str(messages[1]["content"])
            if len(text) > 30_000:
                raise RuntimeError("context length exceeded")
            summaries.append(len(text))
            return LLMResponse(content=f"summary {len(summaries)}")
        if _last(kw)["content"] == "write the report":
            return LLMResponse(content="report line. " * 5_000)  # 70,000 characters
        return LLMResponse(content="ok")

    make_loop(ScriptedProvider(handler=answer), consolidate_above_tokens=250)
    redis = redis_factory()
    client = FrontendClient(redis)
    reply = await client.ask(_msg("long", "write the report"), timeout_s=10)
    assert reply.content.startswith("report line.")
    await client.new("web:long")
    assert (await client.ask(_msg("long", "after"), timeout_s=10)).content == "ok"
    assert await redis.hget(K.session("web:long"), "count") == "2"
    archive = [f["entry"] for _, f in await redis.xrange(K.memory_history("web/scope:team"))]
    assert not any("[RAW]" in e for e in archive), archive  # fails: the answer went raw
    assert len(summaries) == 2


async def test_new_gives_up_after_three_memory_moves_in_all_not_per_part(  # type: ignore[no-untyped-def]
    redis_factory, make_loop
) -> None:
    """Another writer of the scope's memory (a consolidation of another chat of the same
    user, an operator's `memory set`) moves it once during each of three parts' folds.
    Each part succeeds on its second try, as a job's part would (FOLD_ATTEMPTS per part);
    `fold_into_memory` counts the moves over the whole backlog, so the third move makes it
    return "failed": the session is kept half folded, and the user's `new` is dropped."""
    redis = redis_factory()
    memory = MemoryStore(redis_factory(), K)
    calls: list[int] = []

    async def answer(**kw: Any) -> LLMResponse:
        messages = kw["messages"]
        if "Summarise" in str(messages[0]["content"]):
            calls.append(1)
            if len(calls) in (1, 3, 5):  # once in each of parts 1, 2, 3
                await memory.write_memory(f"other fact {len(calls)}", "web/scope:team")
            return LLMResponse(content=f"summary {len(calls)}")
        return LLMResponse(content="ok")

    make_loop(ScriptedProvider(handler=answer), consolidate_above_tokens=250)
    client = FrontendClient(redis)
    for i in range(4):  # 8 rows (no job: 8 are kept), a part each exchange (~225 tokens)
        fact = f"fact number {i}: " + "x" * 900
        assert (await client.ask(_msg("moved", fact), timeout_s=10)).content == "ok"
    await client.new("web:moved")
    assert (await client.ask(_msg("moved", "after"), timeout_s=10)).content == "ok"
    count = await redis.hget(K.session("web:moved"), "count")
    assert count == "2", (count, len(calls))  # fails: ("10", 5)
