"""A long chat and a full Redis (maxmemory reached, noeviction), as a hostile reviewer
attacked them: a cold turn of a chat of 20,000 rows, and a commit refused for memory.
Each test failed on the code before its fix."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from replies import collect, wait_until_async

from bus_redis import FrontendClient, InboundMessage, Keys
from session_store import Session
from session_store.redis_store import RedisSessionStore

pytestmark = [pytest.mark.real_redis, pytest.mark.slow]
K = Keys()


def _m(channel: str, chat: str, text: str, **kw: object) -> InboundMessage:
    return InboundMessage(
        id=f"{chat}:{text}", channel=channel, sender_id="u", chat_id=chat, content=text, **kw
    )  # type: ignore[arg-type]


async def _net_out(r: aioredis.Redis) -> int:
    return int((await r.info("stats"))["total_net_output_bytes"])


async def test_a_cold_turn_of_a_long_chat_reads_only_what_it_needs_from_redis(
    real_redis, spawn_workers
) -> None:  # type: ignore[no-untyped-def]
    """A chat a frontend kept talking in holds 20,000 rows (~10 MB), all but the newest 100
    already consolidated into memory. A worker whose cache does not hold it (any other
    worker, after a restart, or after the row-bounded cache evicted it) answers one
    message: it must not pull the whole history out of Redis in one command (HGETALL
    blocks every channel for as long as the chat is long, and the copy is then cached
    whole)."""
    store = RedisSessionStore(real_redis, K)
    rows: list[dict[str, object]] = []
    for i in range(10_000):
        rows.append({"role": "user", "content": f"{i} " + "x" * 1000})
        rows.append({"role": "assistant", "content": f"answer {i}"})
    await store.save(
        Session(key="web:long", messages=rows, scope="web/sender:u", last_consolidated=19_900)
    )
    history_bytes = sum(len(v) for v in (await real_redis.hvals(K.session("web:long"))))
    assert history_bytes > 10_000_000
    (w,) = spawn_workers(1)

    async def idle() -> bool:  # started, channels subscribed, first ticks done
        return bool(await real_redis.hget(K.worker_info(w.worker_id), "active") == "0")

    assert await wait_until_async(idle, timeout_s=20)
    before = await _net_out(real_redis)
    ev = await FrontendClient(real_redis).ask(_m("web", "long", "one more"), timeout_s=30)
    sent = await _net_out(real_redis) - before
    assert ev.type == "message", ev
    # the prompt window (AGENT_HISTORY_TOKENS 16,000) needs ~64 KB of rows; 2 MB is slack
    assert sent < 2_000_000, (
        f"Redis sent {sent} bytes to answer one message of a {history_bytes}-byte chat"
    )


async def test_a_full_redis_at_a_commit_is_waited_out_not_counted_as_a_delivery(
    real_redis, spawn_workers, fake_llm
) -> None:  # type: ignore[no-untyped-def]
    """Redis reaches maxmemory (noeviction) while a turn runs: its fenced commit is refused
    before it wrote anything. That used to drop the turn like a crash: the lease ran out,
    the message was delivered again and counted, and five such moments in a row (a flood
    keeping Redis at its edge) dead-lettered a message that did nothing wrong. The worker
    now tries the commit again while it holds the lease: once memory is freed the answer
    lands, from the one model call."""
    spawn_workers(1)
    client = FrontendClient(real_redis)
    mid = await client.send(_m("web", "edge", "block edge"))
    assert await asyncio.to_thread(fake_llm.started.wait, 30)
    before = await _oom_errors(real_redis)
    await real_redis.config_set("maxmemory", "1")
    try:
        fake_llm.release()  # answered: its commit meets the full Redis

        async def refused_twice() -> bool:
            return await _oom_errors(real_redis) >= before + 2

        assert await wait_until_async(refused_twice, timeout_s=20)
    finally:
        await real_redis.config_set("maxmemory", "0")  # memory freed
    got = await collect(client, "web", {mid}, timeout_s=30)
    terminal = [ev for ev in got[mid] if ev.is_terminal]
    assert [(ev.type, ev.content) for ev in terminal] == [("message", "re: block edge")]
    assert len(fake_llm.requests) == 1  # delivered once: no second attempt
    assert await real_redis.xlen(K.dead("web")) == 0


async def _oom_errors(redis: aioredis.Redis) -> int:
    stats = await redis.info("errorstats")
    return int((stats.get("errorstat_OOM") or {}).get("count", 0))


async def test_a_full_redis_drops_a_live_piece_of_an_answer_not_the_turn(real_redis) -> None:  # type: ignore[no-untyped-def]
    """A streamed piece (``delta``) refused because Redis is full failed the whole turn
    (a delivery counted, the model asked again); the answer comes whole with its terminal
    event anyway, so the piece is left out and the turn goes on."""
    from helpers import ScriptedProvider

    from bus_redis import RedisBus
    from worker import AgentLoop, LoopConfig
    from worker.agent.providers import LLMResponse

    async def streamed(**kw: object) -> LLMResponse:
        on_delta = kw["on_delta"]
        await real_redis.config_set("maxmemory", "1")
        try:
            await on_delta("a piece")  # type: ignore[operator]
        finally:
            await real_redis.config_set("maxmemory", "0")
        return LLMResponse(content="the whole answer")

    provider = ScriptedProvider(handler=streamed)
    loop = AgentLoop(RedisBus(real_redis), provider, config=LoopConfig(stream_deltas=True))
    reply = await loop.process_message(_m("web", "full", "stream it"))
    assert reply is not None
    assert (reply.type, reply.content) == ("message", "the whole answer")
    assert len(provider.calls) == 1
    await loop.jobs.aclose()
