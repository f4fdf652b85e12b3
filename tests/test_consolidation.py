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
    """Both folds start from the same memory at the same time (on two workers: one worker
    folds one part of a scope at a time); the second to commit finds the memory moved
    (compare-and-set on its version) and folds again from what the first wrote, so the
    memory keeps both facts."""
    handler = _summariser(asyncio.Barrier(2))
    loops = [
        AgentLoop(RedisBus(redis), ScriptedProvider(handler=handler), config=LOW) for _ in range(2)
    ]
    for loop, chat in zip(loops, ("a", "b"), strict=True):
        for i in range(6):
            msg = InboundMessage(
                channel="web", sender_id="u", chat_id=chat, content=f"{chat}{i} " * 9
            )
            await loop.process_message(msg)
    for loop in loops:
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
    from worker.jobs.folds import _read, bounded

    assert _read('{"memory": "", "history": "chat"}', "user is Alice") == ("user is Alice", "chat")
    assert _read('{"memory": "  ", "history": ""}', "") == ("", "consolidated")
    assert _read("plain summary", "old fact") == ("old fact\nplain summary", "plain summary")
    assert bounded("one\ntwo\nthree", 9) == "two\nthree"


# --- a turn loads what it can use, not the whole history -------------------------------
def _seeded(n: int, consolidated: int) -> Session:
    rows = []
    for i in range(0, n, 2):
        rows.append({"role": "user", "content": f"old {i}", "message_id": f"id{i}"})
        rows.append({"role": "assistant", "content": f"answer {i}"})
    return Session(key="web:long", messages=rows, scope=SCOPE, last_consolidated=consolidated)


async def test_a_partly_loaded_session_keeps_and_counts_what_it_left_out(
    redis: aioredis.Redis,
) -> None:
    """A turn's load reads the rows not consolidated and the newest 512, not a history of
    thousands; what it writes back (a turn's commit, a whole save) keeps the rows it left
    out, and its ``last_consolidated`` still counts from the hash's first row."""
    loop = AgentLoop(RedisBus(redis), EchoProvider(), config=LoopConfig(read_block_ms=100))
    store = loop.sessions.store
    await store.save(_seeded(3000, 2900))
    recent = await store.load_recent("web:long")
    assert recent is not None
    assert recent.base == 2900 - 412
    assert len(recent.messages) == 3000 - recent.base
    assert recent.last_consolidated == 412
    reply = await loop.process_message(
        InboundMessage(id="new1", channel="web", sender_id="u", chat_id="long", content="hi")
    )
    assert reply is not None
    assert reply.content
    again = await loop.process_message(  # a re-sent id of a recent row: its answer again
        InboundMessage(id="id2990", channel="web", sender_id="u", chat_id="long", content="x")
    )
    assert again is not None
    assert again.content == "answer 2990"
    assert again.metadata.get("duplicate") is True
    whole = await store.load("web:long")
    assert whole is not None
    assert len(whole.messages) == 3002
    assert whole.messages[0]["content"] == "old 0"
    assert whole.last_consolidated == 2900 == await _last_consolidated(redis)
    recent.add_message("user", "saved whole")  # administration's save of that copy
    await store.save(recent)
    whole = await store.load("web:long")
    assert whole is not None
    assert len(whole.messages) == 3001
    assert whole.messages[0]["content"] == "old 0"
    assert whole.last_consolidated == 2900
    await loop.jobs.aclose()


async def test_a_consolidation_of_a_partly_loaded_session_folds_the_right_rows(
    redis: aioredis.Redis,
) -> None:
    """The job's rows count from the hash's first row: it folds rows 2000-2100 of a chat
    whose load left the first 2000 out, and moves ``last_consolidated`` to 2100 there."""
    folded: list[str] = []

    async def summarise(**kw: Any) -> LLMResponse:
        user = kw["messages"][-1]["content"]
        folded.append(user.split("# Conversation\n", 1)[1])
        return LLMResponse(content=json.dumps({"memory": "m", "history": "h"}))

    one_part = LoopConfig(consolidate_above_tokens=100_000, read_block_ms=100)  # (one fold)
    loop = AgentLoop(RedisBus(redis), ScriptedProvider(handler=summarise), config=one_part)
    await loop.sessions.store.save(_seeded(3000, 2000))
    await loop.consolidator.run_job(key="web:long", start=2000, end=2100)
    assert "old 2000" in folded[0]
    assert "answer 2098" in folded[0]
    assert "old 1998" not in folded[0]
    assert "old 2100" not in folded[0]
    assert await _last_consolidated(redis) == 2100
    await loop.jobs.aclose()


async def test_a_copy_kept_between_turns_forgets_consolidated_rows(redis: aioredis.Redis) -> None:
    """A session whose every turn ran on one worker grew there row by row: its cached copy
    held every row the chat ever had. Between turns it keeps about what a load for a turn
    reads, and what it writes back still counts from the hash's first row."""
    loop = AgentLoop(RedisBus(redis), EchoProvider(), config=LoopConfig(read_block_ms=100))
    store = loop.sessions.store
    await store.save(_seeded(3000, 0))
    whole = await store.load("web:long")
    assert whole is not None
    loop.sessions._remember(whole)  # a copy holding all 3,000 rows
    meta = decode_meta(await redis.hget(Keys().session("web:long"), "meta"))
    meta["last_consolidated"] = 2800  # consolidated meanwhile (as a job commits it)
    await redis.hset(Keys().session("web:long"), "meta", json.dumps(meta))
    await redis.hincrby(Keys().session("web:long"), "version", 1)
    msg = InboundMessage(id="n1", channel="web", sender_id="u", chat_id="long", content="hi")
    assert await loop.process_message(msg) is not None
    cached = loop.sessions.get_cached("web:long")
    assert cached is not None
    assert len(cached.messages) <= 2 * 512
    assert cached.base + len(cached.messages) == 3002
    assert await _last_consolidated(redis) == 2800
    stored = await store.load("web:long")
    assert stored is not None
    assert len(stored.messages) == 3002
    assert stored.messages[0]["content"] == "old 0"
    await loop.jobs.aclose()


async def test_a_dead_workers_running_jobs_are_claimed_once_and_by_channel(
    redis: aioredis.Redis,
) -> None:
    """The entries a worker keeps of the jobs it runs: of two survivors, one claims each
    job; one serving other channels leaves it; an entry that ended is gone."""
    from bus_redis.running_jobs import RunningJobs

    bus = RedisBus(redis)
    dead = RunningJobs(bus, "w-dead", ttl_ms=60_000)
    await dead.started("j1", "consolidate", "web", {"key": "web:a", "start": 0, "end": 4})
    await dead.started("j2", "consolidate", "tg", {"key": "tg:b", "start": 2, "end": 6})
    await dead.started("j3", "consolidate", "web", {"key": "web:c", "start": 0, "end": 2})
    await dead.ended("j3")
    await redis.hset(Keys().worker_jobs("w-dead"), "junk", "not json")
    survivor = RunningJobs(bus, "w1", ttl_ms=60_000)
    other = RunningJobs(bus, "w2", ttl_ms=60_000)
    assert await other.claim("w-dead", {"mail"}) == []
    got = await survivor.claim("w-dead", {"web"})
    assert got == [("j1", "consolidate", {"key": "web:a", "start": 0, "end": 4})]
    assert await other.claim("w-dead", {"web"}) == []  # claimed once
    assert await other.claim("w-dead", {"web", "tg"}) == [
        ("j2", "consolidate", {"key": "tg:b", "start": 2, "end": 6})
    ]
    assert not await redis.exists(Keys().worker_jobs("w-dead"))  # (the junk went too)
    await bus.aclose()
