"""A kill -9 soak: three real worker processes serve twelve sessions while a seeded random
killer SIGKILLs one of them each time eight more messages were answered, and starts a
replacement. Wherever the kills land (a read, an acquire, a model call, a tool, a
commit), the README's promises hold at the end: every message one terminal event, and an
answer, not a dead letter; each session's stored user rows exactly the messages sent, in
order, once; each non-idempotent tool effect once (or, when a kill cut the call itself,
at most once, and the answer says its effect is unknown); never two model calls of one session
at once; no lease, journal, pending set or queued entry left."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from replies import channel_events, collect, no_leftovers
from servers import RedisServer

from bus_redis import FrontendClient, InboundMessage, Keys

pytestmark = [pytest.mark.real_redis, pytest.mark.slow]
ENV = {
    "AGENT_LOCK_TTL_MS": "1000",
    "AGENT_OWNER_TTL_MS": "1500",
    "AGENT_SWEEP_INTERVAL_MS": "500",
    "AGENT_MAX_DELIVERIES": "20",  # a message may be cut by several kills in a row
    "AGENT_FOLLOWUP_MODE": "queue",  # one turn per message: each tool message calls its tool
    "AGENT_CHANNELS": "web",
}
SESSIONS, PER_SESSION, WORKERS = 12, 8, 3
KILLS, EVERY = 6, 8  # a kill each time EVERY more messages were answered


def _text(s: int, i: int) -> str:
    if i % 3 == 1:  # a tool call (the message tool: one progress event per run)
        return f'[s{s}] m{i} toolcall:message{{"content": "effect s{s}-{i}"}} now'
    return f"[s{s}] m{i}"


async def _answered(client: FrontendClient) -> int:
    try:
        return sum(1 for ev in await channel_events(client, "web") if ev.is_terminal)
    except (OSError, RedisConnectionError):  # Redis restarting: asked again
        return 0


async def _user_rows(redis: aioredis.Redis, key: str) -> list[str]:
    h = await redis.hgetall(Keys().session(key))
    rows = [json.loads(h[f"m:{i}"]) for i in range(int(h.get("count", 0)))]
    return [r["content"] for r in rows if r["role"] == "user"]


async def test_random_kills_lose_and_repeat_nothing(real_redis, spawn_workers, fake_llm) -> None:  # type: ignore[no-untyped-def]
    await _soak(real_redis, spawn_workers, fake_llm, None, ["kill"] * KILLS)


async def test_random_kills_and_a_redis_kill_with_aof_lose_and_repeat_nothing(
    spawn_workers, fake_llm
) -> None:  # type: ignore[no-untyped-def]
    """The same, with Redis itself killed -9 and restarted (AOF, fsync always: nothing
    acknowledged is lost) between the worker kills."""
    server = RedisServer(aof=True).start()
    redis = aioredis.from_url(server.url, decode_responses=True)
    try:
        await redis.sadd("agent:channels", "web")
        plan = ["kill", "kill", "redis", "kill", "kill"]
        await _soak(redis, spawn_workers, fake_llm, server, plan, url=server.url)
    finally:
        await redis.aclose()
        server.cleanup()


async def _soak(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, spawn_workers, fake_llm, server: RedisServer | None,
    plan: list[str], url: str | None = None,
) -> None:  # fmt: skip
    fake_llm.latency_s = (0.005, 0.03)  # kills land inside model calls too
    rng = random.Random(20261205)
    live: list[Any] = spawn_workers(WORKERS, env=ENV, url=url)
    client = FrontendClient(redis)
    ids = {}
    for i in range(PER_SESSION):  # each session's messages in order
        for s in range(SESSIONS):
            msg = InboundMessage(
                id=f"s{s}-{i}", channel="web", sender_id="u", chat_id=f"s{s}", content=_text(s, i)
            )
            ids[msg.id] = await client.send(msg)
    at = []  # how many were answered when each step came
    for n, step in enumerate(plan):
        while await _answered(client) < EVERY * (n + 1):
            await asyncio.sleep(0.01)  # poll: the answers come from other processes
        at.append(await _answered(client))
        if step == "redis":
            assert server is not None
            server.stop(kill=True)
            server.start()  # same port, same AOF
            continue
        victim = live.pop(rng.randrange(len(live)))
        victim.kill()
        assert await asyncio.to_thread(victim.proc.wait, 30) == -9
        live += spawn_workers(1, env=ENV, url=url)
    got = await collect(client, "web", set(ids), timeout_s=60)

    assert at[-1] < len(ids), at  # every step came while messages were still waiting
    for mid in ids:
        terminal = [ev for ev in got[mid] if ev.is_terminal]
        assert [ev.type for ev in terminal] == ["message"], (mid, terminal)
    for s in range(SESSIONS):
        key = f"web:s{s}"
        assert await _user_rows(redis, key) == [_text(s, i) for i in range(PER_SESSION)]
        events = [json.loads(f["payload"]) for _, f in await redis.xrange(Keys().out(key))]
        for i in range(1, PER_SESSION, 3):
            effects = [e for e in events if e.get("content") == f"effect s{s}-{i}"]
            (answer,) = [ev for ev in got[f"s{s}-{i}"] if ev.is_terminal]
            unknown = (answer.metadata.get("resumed") or {}).get("unknown_effects", [])
            # once; or, when a kill cut the call itself, at most once and said so
            assert len(effects) == 1 or (not effects and unknown == ["message"]), (key, i)
    assert fake_llm.overlaps == 0
    await no_leftovers(redis, [f"web:s{s}" for s in range(SESSIONS)])
