"""Token-based consolidation: durable sessions only, as a deduplicated background job
(in-process queue on both backends; arq on the real server)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import redis.asyncio as aioredis
from helpers import ScriptedProvider
from replies import collect, wait_until_async

from bus_redis import FrontendClient, InboundMessage, Keys, RedisBus
from session_store import Session
from session_store.codec import decode_meta
from worker import AgentLoop, LoopConfig
from worker.agent.providers import EchoProvider, LLMResponse
from worker.jobs.arq_queue import ArqJobQueue
from worker.jobs.consolidation import KEEP_RECENT

LOW = LoopConfig(consolidate_above_tokens=60, read_block_ms=100)


def _m(i: int) -> InboundMessage:
    return InboundMessage(
        id=f"m{i}", channel="web", sender_id="u", chat_id="long", content=f"fact number {i} " * 3
    )


SCOPE = "web/sender:u"  # no vouched scope: the sender's own


async def _last_consolidated(redis: aioredis.Redis, key: str = "web:long") -> int:
    meta = decode_meta(await redis.hget(Keys().session(key), "meta"))
    return int(meta.get("last_consolidated", 0))


async def test_long_durable_session_is_folded_into_memory(redis: aioredis.Redis) -> None:
    loop = AgentLoop(RedisBus(redis), EchoProvider(), config=LOW)
    for i in range(6):
        await loop.process_message(_m(i))
    await loop.jobs.aclose()  # wait for the queued job

    folded = await _last_consolidated(redis)
    stored = await loop.sessions.read_session("web:long")
    assert stored is not None
    assert folded > 0
    assert folded <= len(stored["messages"]) - KEEP_RECENT
    assert "fact number 0" in await loop.memory.read_memory(SCOPE)
    assert await loop.memory.read_memory("web/sender:someone-else") == ""
    assert len(stored["messages"]) == 12  # nothing is deleted, the offset moves


def _summariser(gate: asyncio.Barrier | None = None) -> Any:
    """A model that folds well: the memory it is given plus one line per conversation,
    as JSON. With ``gate``, the first fold of each chat waits for the other's."""
    first: set[str] = set()

    async def summarise(**kw: Any) -> LLMResponse:
        if kw.get("tools") is not None or "Summarise" not in kw["messages"][0]["content"]:
            return LLMResponse(content="ok")
        user = kw["messages"][-1]["content"]
        current = user.split("# Current memory\n", 1)[1].split("\n\n# Conversation\n")[0]
        chat = user.split("# Conversation\n", 1)[1].split()[1]  # "user: a0 a0 ..."
        if gate is not None and chat not in first:
            first.add(chat)
            await gate.wait()
        lines = [line for line in current.splitlines() if line != "(empty)"]
        memory = "\n".join([*lines, f"summary of {chat}"])
        return LLMResponse(content=json.dumps({"memory": memory, "history": f"about {chat}"}))

    return summarise


async def test_two_consolidations_of_one_scope_keep_both_summaries(redis: aioredis.Redis) -> None:
    """Both folds start from the same memory at the same time; the second to commit finds
    the memory moved (compare-and-set on its version) and folds again from what the first
    wrote, so the memory keeps both facts."""
    handler = _summariser(asyncio.Barrier(2))
    loop = AgentLoop(RedisBus(redis), ScriptedProvider(handler=handler), config=LOW)
    for chat in ("a", "b"):
        for i in range(6):
            msg = InboundMessage(
                channel="web", sender_id="u", chat_id=chat, content=f"{chat}{i} " * 9
            )
            await loop.process_message(msg)
    await loop.jobs.aclose()

    memory = await loop.memory.read_memory(SCOPE)
    assert "summary of a0" in memory
    assert "summary of b0" in memory
    assert await _last_consolidated(redis, "web:a") > 0
    assert await _last_consolidated(redis, "web:b") > 0
    archive = [f["entry"] for _, f in await redis.xrange(Keys().memory_history(SCOPE))]
    assert sorted(e.split("] ", 1)[1] for e in archive) == ["about a0", "about b0"]
    assert all(e.startswith("[20") for e in archive)  # dated


async def test_memory_stays_within_its_budget(redis: aioredis.Redis) -> None:
    """A model that only ever adds (or answers without the JSON asked for): the memory is
    cut to AGENT_MEMORY_MAX_CHARS, keeping the newest lines; the archive keeps every
    entry."""

    async def verbose(**kw: Any) -> LLMResponse:
        if kw.get("tools") is None and "Summarise" in kw["messages"][0]["content"]:
            convo = kw["messages"][-1]["content"].split("# Conversation\n", 1)[1]
            return LLMResponse(content=f"noted {convo.split()[1]} " + "detail " * 30)
        return LLMResponse(content="ok")

    config = LOW.model_copy(update={"memory_max_chars": 300})
    loop = AgentLoop(RedisBus(redis), ScriptedProvider(handler=verbose), config=config)
    for i in range(40):
        msg = InboundMessage(channel="web", sender_id="u", chat_id="grow", content=f"x{i} " * 9)
        await loop.process_message(msg)
        await loop.jobs.aclose()
    memory = await loop.memory.read_memory(SCOPE)
    assert 0 < len(memory) <= 300
    assert memory.splitlines()[-1].startswith("noted x")  # the newest line is whole
    prompt = loop.rt.runner.context.system_prompt(memory)
    assert len(prompt) < len(loop.rt.runner.context.static_prompt()) + 400  # bounded prompt
    assert await redis.xlen(Keys().memory_history(SCOPE)) > 3


async def test_transient_sessions_are_never_consolidated(redis: aioredis.Redis) -> None:
    loop = AgentLoop(RedisBus(redis), EchoProvider(), config=LOW)
    session = loop.sessions.get_or_create_transient("web:private")
    rows = [{"role": "user", "content": "secret " * 100} for _ in range(20)]
    session.append_rows(rows)  # far over budget, and more than KEEP_RECENT rows
    session.scope = SCOPE
    durable = Session(key="web:twin", scope=SCOPE)
    durable.append_rows(rows)
    assert await loop.consolidator.maybe_consolidate_by_tokens(durable)  # the contrast
    assert not await loop.consolidator.maybe_consolidate_by_tokens(session)
    await loop.consolidator.run_job(key="web:private", start=0, end=1)  # a forged job does nothing
    assert await loop.memory.read_memory() == ""
    assert await loop.memory.read_memory(SCOPE) == ""


@pytest.mark.real_redis
async def test_consolidation_runs_as_a_deduplicated_arq_job(
    real_redis: aioredis.Redis, redis_server
) -> None:  # type: ignore[no-untyped-def]
    jobs = ArqJobQueue(redis_server.url, "agent")
    queue = LOW.model_copy(update={"followup_mode": "queue"})  # a turn per message
    loop = AgentLoop(RedisBus(real_redis), EchoProvider(), jobs=jobs, config=queue)
    client = FrontendClient(aioredis.from_url(redis_server.url, decode_responses=True))
    task = asyncio.create_task(loop.run())
    try:
        assert await jobs.enqueue(
            "consolidate", job_id="consolidate:web:none", key="web:none", start=0, end=1
        )
        assert not await jobs.enqueue(
            "consolidate", job_id="consolidate:web:none", key="web:none", start=0, end=1
        )
        ids = {await client.send(_m(i)) for i in range(6)}
        await collect(client, "web", ids)

        async def folded() -> bool:
            return await _last_consolidated(real_redis) > 0

        assert await wait_until_async(folded, timeout_s=20)
        assert "fact number 0" in await loop.memory.read_memory(SCOPE)
    finally:
        loop.stop()
        await asyncio.wait_for(task, 20)
        await client.redis.aclose()


def test_an_empty_memory_answer_forgets_nothing() -> None:
    """Review: ``{"memory": ""}`` once replaced every fact; it keeps the current memory."""
    from worker.jobs.consolidation import _read, bounded

    assert _read('{"memory": "", "history": "chat"}', "user is Alice") == ("user is Alice", "chat")
    assert _read('{"memory": "  ", "history": ""}', "") == ("", "consolidated")
    assert _read("plain summary", "old fact") == ("old fact\nplain summary", "plain summary")
    assert bounded("one\ntwo\nthree", 9) == "two\nthree"
