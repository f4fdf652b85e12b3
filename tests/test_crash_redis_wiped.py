"""Redis restarted without persistence (everything lost) under a running turn, with real
worker processes: the turn's message is gone with the stream, so the worker's commit is
fenced out (its lease is gone too) and writes nothing: no half session, no answer to a
message that no longer exists, no lease or journal left; the worker serves the next
message of the same chat, which starts the conversation afresh. A private session whose
owner record was wiped is forgotten by its owner too: its next messages are refused as not
active (never run as a fresh conversation by another worker), and no worker keeps it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import redis.asyncio as aioredis
from replies import channel_events, collect, no_leftovers, until
from servers import RedisServer

from bus_redis import FrontendClient, InboundMessage, Keys

pytestmark = [pytest.mark.real_redis, pytest.mark.slow]
FAST = {"AGENT_LOCK_TTL_MS": "1000", "AGENT_OWNER_TTL_MS": "1500", "AGENT_CHANNELS": "web"}


def _m(chat: str, mid: str, text: str, **kw: Any) -> InboundMessage:
    return InboundMessage(id=mid, channel="web", sender_id="u", chat_id=chat, content=text, **kw)


async def test_a_wiped_redis_under_a_running_turn_leaves_nothing_half_written(
    spawn_workers, fake_llm
) -> None:  # type: ignore[no-untyped-def]
    server = RedisServer(aof=False).start()
    redis = None
    try:
        spawn_workers(1, env=FAST, url=server.url)
        redis = aioredis.from_url(server.url, decode_responses=True)
        client = FrontendClient(redis)
        await client.send(_m("w", "w1", "block across a wipe"))
        assert await asyncio.to_thread(fake_llm.started.wait, 20)
        await redis.aclose()
        server.stop(kill=True)
        server.start()  # same port, nothing kept
        redis = aioredis.from_url(server.url, decode_responses=True)
        await redis.sadd("agent:channels", "web")  # the operator registers the channel again
        fake_llm.release()  # the cut-off turn ends now and tries to commit
        client = FrontendClient(redis)
        later = await client.send(_m("w", "w2", "after the wipe"))
        got = await collect(client, "web", {later}, timeout_s=40)

        assert [ev.type for ev in got[later] if ev.is_terminal] == ["message"]
        assert "w1" not in got  # no answer to a message Redis no longer holds
        h = await redis.hgetall(Keys().session("web:w"))
        rows = [json.loads(h[f"m:{i}"]) for i in range(int(h["count"]))]
        assert [(r["role"], r["content"]) for r in rows] == [
            ("user", "after the wipe"),
            ("assistant", "re: after the wipe"),
        ]
        await no_leftovers(redis, ["web:w"])
    finally:
        if redis is not None:
            await redis.aclose()
        server.cleanup()


async def test_a_private_session_wiped_with_redis_is_not_run_with_its_old_conversation(
    spawn_workers, fake_llm
) -> None:  # type: ignore[no-untyped-def]
    server = RedisServer(aof=False).start()
    redis = None
    try:
        workers = spawn_workers(2, env=FAST, url=server.url)
        redis = aioredis.from_url(server.url, decode_responses=True)
        client = FrontendClient(redis)
        key, opened = await client.open_transient("web", "p", session_key="web:p-private")
        await collect(client, "web", {opened}, timeout_s=20)
        private = {"session_key_override": key, "require_existing_session": True}
        first = await client.send(_m("p", "p1", "the secret is 42", **private))
        await collect(client, "web", {first}, timeout_s=20)
        await redis.aclose()
        server.stop(kill=True)
        server.start()  # the owner record is gone; the owner still holds the session
        redis = aioredis.from_url(server.url, decode_responses=True)
        await redis.sadd("agent:channels", "web")
        client = FrontendClient(redis)
        before = len(fake_llm.requests)
        asks = [await client.send(_m("p", f"p{i}", f"what is it? {i}", **private)) for i in (2, 3)]
        got = await collect(client, "web", set(asks), timeout_s=40)

        for mid in asks:
            [answer] = [ev for ev in got[mid] if ev.is_terminal]
            # answered in the owner's session (it kept it), or refused as not active:
            # never a fresh conversation that another worker opened on the key
            assert answer.code in (None, "session_not_active", "session_lost"), answer
        codes = [ev.code for mid in asks for ev in got[mid] if ev.is_terminal]
        seen = [json.dumps(r) for r in fake_llm.requests[before:]]
        assert len(seen) == codes.count(None), (codes, seen)
        assert all("the secret is 42" in request for request in seen), (codes, seen)

        async def forgotten() -> bool:  # no worker keeps the wiped session in memory
            infos = [await redis.hgetall(Keys().worker_info(w.worker_id)) for w in workers]
            return all(i.get("transient") == "0" for i in infos)

        await until(forgotten, timeout_s=20)
        assert not await redis.exists(Keys().session(key))  # nothing of it stored
        await no_leftovers(redis, [key])
        assert await channel_events(client, "web")
    finally:
        if redis is not None:
            await redis.aclose()
        server.cleanup()
