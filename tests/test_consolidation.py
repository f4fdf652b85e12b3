"""Token-based consolidation: durable sessions only, as a deduplicated background job
(in-process queue on both backends; arq on the real server)."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from replies import collect, wait_until_async

from bus_redis import FrontendClient, InboundMessage, RedisBus
from session_store.codec import decode_meta
from worker import AgentLoop, LoopConfig
from worker.consolidator import KEEP_RECENT
from worker.jobs.arq_queue import ArqJobQueue
from worker.providers import EchoProvider

LOW = LoopConfig(consolidate_above_tokens=60, read_block_ms=100)


def _m(i: int) -> InboundMessage:
    return InboundMessage(
        id=f"m{i}", channel="web", sender_id="u", chat_id="long", content=f"fact number {i} " * 3
    )


async def _last_consolidated(redis: aioredis.Redis) -> int:
    return int(
        decode_meta(await redis.hget("agent:{web:long}:session", "meta")).get(
            "last_consolidated", 0
        )
    )


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
    assert "fact number 0" in await loop.memory.read_memory()
    assert len(stored["messages"]) == 12  # nothing is deleted, the offset moves


async def test_transient_sessions_are_never_consolidated(redis: aioredis.Redis) -> None:
    loop = AgentLoop(RedisBus(redis), EchoProvider(), config=LOW)
    session = loop.sessions.get_or_create_transient("web:private")
    session.append_rows([{"role": "user", "content": "secret " * 100}])
    assert not await loop.consolidator.maybe_consolidate_by_tokens(session)
    await loop.consolidator.run_job(key="web:private", start=0, end=1)  # a forged job does nothing
    assert await loop.memory.read_memory() == ""


@pytest.mark.real_redis
async def test_consolidation_runs_as_a_deduplicated_arq_job(
    real_redis: aioredis.Redis, redis_server
) -> None:  # type: ignore[no-untyped-def]
    jobs = ArqJobQueue(redis_server.url, "agent")
    loop = AgentLoop(RedisBus(real_redis), EchoProvider(), jobs=jobs, config=LOW)
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
        assert "fact number 0" in await loop.memory.read_memory()
    finally:
        loop.stop()
        await asyncio.wait_for(task, 20)
        await client.redis.aclose()
