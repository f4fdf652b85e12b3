"""Bounded retention: durable sessions idle longer than AGENT_SESSION_TTL_S go with their
indexes and events (the sweeping worker, a batch per channel and period), and
``sessions prune --older-than`` does the same at once; a busy session is left alone."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from types import SimpleNamespace

import redis.asyncio as aioredis
from helpers import ScriptedProvider
from replies import wait_until_async

from bus_redis import FrontendClient, InboundMessage, Keys
from session_store import RedisSessionStore
from worker.agent.providers import LLMResponse
from worker.jobs.folds import RAW_CUT, RAW_MAX_BYTES, raw_fold

K = Keys()


async def _ok(**_kw: object) -> LLMResponse:
    return LLMResponse(content="ok")


def _msg(chat: str, text: str = "hi") -> InboundMessage:
    return InboundMessage(channel="web", sender_id="u", chat_id=chat, content=text, scope="team")


def _leftovers(keys: list[str], session: str) -> list[str]:
    return [k for k in keys if session in k]


async def test_idle_sessions_expire_with_everything_of_them(redis_factory, make_loop) -> None:  # type: ignore[no-untyped-def]
    make_loop(ScriptedProvider(handler=_ok), session_ttl_s=1, sweep_interval_ms=50, lock_ttl_ms=600)
    redis = redis_factory()
    client = FrontendClient(redis)
    assert (await client.ask(_msg("old"), timeout_s=10)).content == "ok"
    assert await redis.exists(K.session("web:old"))
    assert await redis.zscore(K.scope_sessions("web/scope:team"), "web:old")

    async def gone() -> bool:
        keys = [k async for k in redis.scan_iter(count=1000)]
        return not _leftovers(keys, "web:old")  # hash, events, channel and scope indexes

    assert await wait_until_async(gone, timeout_s=15)
    assert not await redis.zscore(K.sessions_index("web"), "web:old")
    assert not await redis.zscore(K.scope_sessions("web/scope:team"), "web:old")
    # a new message starts a new session
    assert (await client.ask(_msg("old", "again"), timeout_s=10)).content == "ok"
    assert await redis.hget(K.session("web:old"), "count") == "2"


async def test_prune_leaves_busy_and_recent_sessions(redis: aioredis.Redis, make_loop) -> None:  # type: ignore[no-untyped-def]
    make_loop(ScriptedProvider(handler=_ok), session_ttl_s=0)  # the worker never prunes
    client = FrontendClient(redis)
    for chat in ("a", "b", "busy"):
        assert (await client.ask(_msg(chat), timeout_s=10)).content == "ok"
    store = RedisSessionStore(redis, K)
    await redis.zadd(K.sessions_index("web"), {"web:a": 1, "web:busy": 1})  # long idle
    await redis.set(K.lease("web:busy"), "n|someone", px=5000)  # a turn runs
    assert await store.prune_idle("web", 60_000) == ["web:a"]
    assert not await redis.exists(K.session("web:a"), K.out("web:a"))
    assert await redis.exists(K.session("web:b"), K.session("web:busy"))


def test_prune_command(redis_server) -> None:  # type: ignore[no-untyped-def]
    async def seed() -> None:
        redis = aioredis.from_url(redis_server.url, decode_responses=True)
        await redis.flushall()
        await redis.sadd("agent:channels", "web")
        await redis.hset(K.session("web:x"), mapping={"meta": "{}", "count": "0", "version": "1"})
        await redis.zadd(K.sessions_index("web"), {"web:x": 1})
        await redis.aclose()

    asyncio.run(seed())
    res = subprocess.run(
        [sys.executable, "-m", "worker.cli.main", "sessions", "prune", "--older-than", "30d",
         "--redis-url", redis_server.url],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "deleted 1 sessions idle for at least 2592000 s"
    bad = subprocess.run(
        [sys.executable, "-m", "worker.cli.main", "sessions", "prune", "--older-than", "soon"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2
    assert "not an age like 30d" in bad.stderr


async def test_new_folds_the_conversation_into_memory_then_starts_afresh(  # type: ignore[no-untyped-def]
    redis_factory, make_loop
) -> None:
    calls: list[list[dict[str, object]]] = []

    async def answer(**kw: object) -> LLMResponse:
        messages = kw["messages"]
        calls.append(messages)  # type: ignore[arg-type]
        if "Summarise" in str(messages[0]["content"]):  # type: ignore[index]
            return LLMResponse(content="the user's name is Ada")
        return LLMResponse(content="ok")

    make_loop(ScriptedProvider(handler=answer))
    redis = redis_factory()
    client = FrontendClient(redis)
    assert (await client.ask(_msg("n", "my name is Ada"), timeout_s=10)).content == "ok"
    await client.new("web:n")
    assert (await client.ask(_msg("n", "who am I?"), timeout_s=10)).content == "ok"
    summary_call = next(c for c in calls if "Summarise" in str(c[0]["content"]))
    assert "my name is Ada" in str(summary_call[1]["content"])
    memory = await redis.hget(K.memory("web/scope:team"), "content")
    assert memory == "the user's name is Ada"
    last = calls[-1]
    assert "the user's name is Ada" in str(last[0]["content"])  # memory in the new prompt
    assert [m["content"] for m in last[1:]] == ["who am I?"]  # the old rows are gone
    assert await redis.hget(K.session("web:n"), "count") == "2"


async def test_new_folds_a_backlog_larger_than_a_part_in_parts(  # type: ignore[no-untyped-def]
    redis_factory, make_loop
) -> None:
    """`new` sent the whole backlog in one request: one larger than the model's context
    failed every time, and the conversation went to the archive as raw rows instead of
    into memory. It now folds parts of about the consolidation threshold, each committed."""
    summaries: list[str] = []

    async def answer(**kw: object) -> LLMResponse:
        messages = kw["messages"]
        if "Summarise" in str(messages[0]["content"]):  # type: ignore[index]
            text = str(messages[1]["content"])  # type: ignore[index]
            if text.count("fact number") > 2:
                raise RuntimeError("context length exceeded")  # more than a part: too long
            summaries.append(text)
            return LLMResponse(content=f"summary {len(summaries)}")
        return LLMResponse(content="ok")

    make_loop(ScriptedProvider(handler=answer), consolidate_above_tokens=250)
    redis = redis_factory()
    client = FrontendClient(redis)
    for i in range(3):  # 6 rows of about 100 tokens each (8 are kept by the jobs)
        fact = f"fact number {i}: " + "x" * 400
        assert (await client.ask(_msg("parts", fact), timeout_s=10)).content == "ok"
    await client.new("web:parts")
    assert (await client.ask(_msg("parts", "after"), timeout_s=10)).content == "ok"
    assert [s.count("fact number") for s in summaries] == [2, 1]  # parts of <= 250 tokens
    assert await redis.hget(K.memory("web/scope:team"), "content") == "summary 1\nsummary 2"
    archive = [f["entry"] for _, f in await redis.xrange(K.memory_history("web/scope:team"))]
    assert len(archive) == 2
    assert not any("[RAW]" in e for e in archive)
    assert await redis.hget(K.session("web:parts"), "count") == "2"


async def test_new_in_unified_mode_starts_the_shared_conversation_afresh(  # type: ignore[no-untyped-def]
    redis_factory, make_loop
) -> None:
    """Unified mode: a chat's history is the shared session's, so `new` on any chat folds
    that session into memory and clears it (nanobot's /new there), not a session stored
    under the chat's own key (there is none)."""
    calls: list[list[dict[str, object]]] = []

    async def answer(**kw: object) -> LLMResponse:
        messages = kw["messages"]
        calls.append(messages)  # type: ignore[arg-type]
        if "Summarise" in str(messages[0]["content"]):  # type: ignore[index]
            return LLMResponse(content="the user's name is Ada")
        return LLMResponse(content="ok")

    make_loop(ScriptedProvider(handler=answer), unified_session=True)
    redis = redis_factory()
    client = FrontendClient(redis)
    assert (await client.ask(_msg("a", "my name is Ada"), timeout_s=10)).content == "ok"
    await client.new("web:b")  # another chat: the conversation is one
    assert (await client.ask(_msg("b", "who am I?"), timeout_s=10)).content == "ok"
    summary_call = next(c for c in calls if "Summarise" in str(c[0]["content"]))
    assert "my name is Ada" in str(summary_call[1]["content"])
    last = calls[-1]
    assert "the user's name is Ada" in str(last[0]["content"])  # memory in the new prompt
    assert [m["content"] for m in last[1:]] == ["who am I?"]  # the old rows are gone
    assert await redis.hget(K.session("unified:default"), "count") == "2"


async def test_new_starts_afresh_when_the_summary_fails_and_archives_the_rows(  # type: ignore[no-untyped-def]
    redis_factory, make_loop
) -> None:
    """As nanobot's /new: the conversation is cleared even when the summary fails; its
    rows are kept, as they are, in the scope's history archive (a [RAW] entry) and the
    memory is left as it was."""
    prompts: list[list[dict[str, object]]] = []

    async def answer(**kw: object) -> LLMResponse:
        messages = kw["messages"]
        if "Summarise" in str(messages[0]["content"]):  # type: ignore[index]
            raise RuntimeError("the model is down")
        prompts.append(messages)  # type: ignore[arg-type]
        return LLMResponse(content="ok")

    make_loop(ScriptedProvider(handler=answer))
    redis = redis_factory()
    client = FrontendClient(redis)
    await redis.hset(K.memory("web/scope:team"), mapping={"content": "likes tea", "version": 3})
    assert (await client.ask(_msg("k", "remember me"), timeout_s=10)).content == "ok"
    await client.new("web:k")
    assert (await client.ask(_msg("k", "still there?"), timeout_s=10)).content == "ok"
    assert [m["content"] for m in prompts[-1][1:]] == ["still there?"]  # a new conversation
    assert await redis.hget(K.session("web:k"), "count") == "2"
    assert await redis.hget(K.memory("web/scope:team"), "content") == "likes tea"
    archive = await redis.xrange(K.memory_history("web/scope:team"))
    assert len(archive) == 1
    entry = archive[0][1]["entry"]
    assert "[RAW] 2 messages" in entry
    assert "user: remember me" in entry  # nothing lost
    assert "assistant: ok" in entry


async def test_a_raw_archive_entry_keeps_the_newest_rows_within_its_bound() -> None:
    """A [RAW] entry is one script argument: at most RAW_MAX_BYTES of UTF-8 in all (the
    compose file's proto-max-bulk-len is 1 MB), the transcript's newest bytes kept, never
    half a character, and never nothing (a newest row alone over the bound)."""

    class Memory:
        async def read_memory(self, scope: str) -> str:
            return "likes tea"

        def version(self, scope: str) -> int:
            return 7

    rt = SimpleNamespace(memory=Memory())
    rows = [{"role": "user", "content": f"row {i} " + "é" * 1000} for i in range(600)]
    folded = await raw_fold(rt, "web/scope:team", rows)  # type: ignore[arg-type]
    head, _, body = folded.history.partition("\n")
    assert head.endswith("[RAW] 600 messages")
    assert RAW_MAX_BYTES - 1 <= len(folded.history.encode()) <= RAW_MAX_BYTES  # (é: 2 bytes)
    assert body.startswith(RAW_CUT)
    assert body.endswith("row 599 " + "é" * 1000)
    assert (folded.memory, folded.memory_version) == ("likes tea", 7)
    exact = [{"role": "user", "content": "y" * RAW_MAX_BYTES}]  # with its header: over
    assert len((await raw_fold(rt, "s", exact)).history.encode()) == RAW_MAX_BYTES  # type: ignore[arg-type]
    huge = [rows[0], {"role": "user", "content": "x" * (2 * RAW_MAX_BYTES) + "the end"}]
    alone = (await raw_fold(rt, "web/scope:team", huge)).history  # type: ignore[arg-type]
    assert len(alone.encode()) == RAW_MAX_BYTES
    assert alone.partition("\n")[2].startswith(RAW_CUT + "xxx")
    assert alone.endswith("x" * 1000 + "the end")  # its newest part, not nothing
    small = await raw_fold(rt, "web/scope:team", rows[:2])  # type: ignore[arg-type]
    assert small.history.partition("\n")[2] == "\n".join(
        f"user: row {i} " + "é" * 1000 for i in range(2)
    )
