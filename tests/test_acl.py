"""The generated ACLs (``agent-worker acl``) applied to a real redis-server: a frontend of
channel web can send, stop/discard and read its events, and gets NOPERM (or no effect)
for everything else: other channels' queues, streams, controls and replies, sessions,
memory, leases, dead letters, its own queued entries, and Lua. Workers run under theirs."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

import pytest
import redis.asyncio as aioredis
from helpers import ScriptedProvider
from redis.exceptions import NoPermissionError

from bus_redis import FrontendClient, InboundMessage, Keys, RedisBus
from bus_redis.acl import frontend_acl, worker_acl
from worker import AgentLoop, LoopConfig
from worker.agent.providers import LLMResponse

pytestmark = pytest.mark.real_redis


async def _user(admin: aioredis.Redis, url: str, lines: list[str], name: str) -> aioredis.Redis:
    for line in lines:
        await admin.execute_command(*line.split())
    return aioredis.from_url(
        url.replace("redis://", f"redis://{name}:s3cret-pw@"), decode_responses=True
    )


async def test_generated_acls_confine_a_frontend_to_its_channel(
    real_redis: aioredis.Redis, redis_server
) -> None:  # type: ignore[no-untyped-def]
    url = redis_server.url
    web = await _user(real_redis, url, frontend_acl("web", "s3cret-pw"), "frontend-web")
    worker_redis = await _user(real_redis, url, worker_acl("s3cret-pw"), "agent-worker")
    seen: list[str] = []

    async def answer(**kw: object) -> LLMResponse:
        seen.append(str(kw["messages"]))
        return LLMResponse(content="ok")

    loop = AgentLoop(
        RedisBus(worker_redis),
        ScriptedProvider(handler=answer),
        config=LoopConfig(read_block_ms=100),
    )
    task = asyncio.create_task(loop.run())
    other = FrontendClient(real_redis)  # telegram's traffic, published by its own frontend
    pin = InboundMessage(
        channel="telegram", sender_id="alice", chat_id="alice", content="my PIN is PIN-4711-XQZ"
    )
    try:
        assert (await other.ask(pin, timeout_s=10)).content == "ok"
        client = FrontendClient(web)
        ev = await client.ask(
            InboundMessage(channel="web", sender_id="u", chat_id="1", content="hi"), timeout_s=10
        )
        assert ev.content == "ok"
        key, _ = await client.open_transient("web", "2", session_key="web:2-private")
        private = InboundMessage(
            channel="web",
            sender_id="u",
            chat_id="2",
            content="psst",
            session_key_override=key,
            require_existing_session=True,
        )
        assert (await client.ask(private, timeout_s=10)).content == "ok"
        assert await client.stop("web:1") >= 1
        assert await client.discard(key) >= 1

        # a payload in its own stream naming telegram's session is refused, never run
        forged = '{"v":2,"channel":"web","sender_id":"u","chat_id":"1","session_key_override":"telegram:alice"}'
        await client.send_raw("web:1", forged)
        refused = await client.ask(
            InboundMessage(channel="web", sender_id="u", chat_id="1", content="after"), timeout_s=10
        )
        assert refused.content == "ok"
        events = [e async for e in _first(client.events(["web:1"], after="0"), 10)]
        assert "invalid_message" in [e.code for e in events]

        k = Keys()
        forbidden: list[Awaitable[object]] = [
            web.xrange(k.inbound("telegram:alice")),  # read another channel's queue
            web.xrevrange(k.inbound("web:1")),  # even its own queued entries (private text)
            web.xdel(k.inbound("telegram:alice"), "0-1"),
            web.set(k.control_hint("telegram:alice"), "9"),
            web.xadd(k.inbound("telegram:alice"), {"control": "stop"}),
            web.xadd(k.ready("telegram"), {"session": "telegram:alice"}, maxlen=0),
            web.xrange(k.out("telegram:alice")),
            web.publish(k.control("telegram"), "{}"),
            web.hgetall(k.session("web:1")),
            web.hgetall(k.memory("web/sender:u")),
            web.get(k.lease("web:1")),
            web.xrange(k.dead("web")),
            web.smembers(k.channels),
            web.eval("while true do end", 0),
            web.xadd(k.control_hint("web:1"), {"a": "b"}),  # a type workers do not expect
            web.incrby(k.out("web:1"), 1),
            web.xadd(k.out("web:1"), {"payload": "{}"}),  # forged events
            web.set(k.inbound("web:1"), "x"),
            web.scan(0),
        ]
        for call in forbidden:
            with pytest.raises(NoPermissionError):
                await call
        assert sum("PIN-4711-XQZ" in s for s in seen) == 1  # only telegram's own turn ever saw it
    finally:
        loop.stop()
        await asyncio.wait_for(task, 10)
        await web.aclose()
        await worker_redis.aclose()
        for user in ("frontend-web", "agent-worker"):
            await real_redis.execute_command("ACL", "DELUSER", user)


async def _first(events, timeout_s: float):  # type: ignore[no-untyped-def]
    """Events already kept, then stop (a bounded read of a never-ending iterator)."""
    it = events.__aiter__()
    while True:
        try:
            yield await asyncio.wait_for(it.__anext__(), 0.5)
        except TimeoutError:
            return


def test_docs_show_exactly_the_generated_lines() -> None:
    """docs/ACL.md quotes what `agent-worker acl` prints, line for line."""
    from pathlib import Path

    from bus_redis.acl import gateway_acl

    doc = (Path(__file__).resolve().parents[1] / "docs" / "ACL.md").read_text()
    pw = "CHANGE-ME-PLEASE"
    for line in [*frontend_acl("web", pw), *gateway_acl("web", pw), *worker_acl(pw)]:
        assert line in doc, line


async def test_a_frontend_publishing_into_another_channel_writes_nothing_and_keeps_its_connection(
    real_redis: aioredis.Redis, redis_server
) -> None:  # type: ignore[no-untyped-def]
    """FrontendClient publishes over a pipelined connection of its own (MULTI ... EXEC as
    one unit): a block the ACL refuses raises NOPERM, runs none of its writes (the
    transaction aborts) and leaves that connection usable for the next, allowed block."""
    web = await _user(
        real_redis, redis_server.url, frontend_acl("web", "s3cret-pw"), "frontend-web"
    )
    client = FrontendClient(web)
    k = Keys()
    try:
        hostile = InboundMessage(channel="telegram", sender_id="u", chat_id="alice", content="x")
        for _ in range(3):
            with pytest.raises(NoPermissionError):
                await client.send(hostile)
        assert client._mux is not None  # the pipelined path was the one refused
        assert not await real_redis.exists(
            k.inbound("telegram:alice"), k.ready("telegram"), k.queued("telegram")
        )
        mine = await client.send(
            InboundMessage(channel="web", sender_id="u", chat_id="1", content="y")
        )
        assert [e for e, _ in await real_redis.xrange(k.inbound("web:1"))] == [mine]
        assert await real_redis.xlen(k.ready("web")) == 1
    finally:
        await client.aclose()
        await web.aclose()
        await real_redis.execute_command("ACL", "DELUSER", "frontend-web")


async def test_a_frontend_may_name_its_connection_and_select_database_0_only(
    real_redis: aioredis.Redis, redis_server
) -> None:  # type: ignore[no-untyped-def]
    """Client libraries send ``CLIENT SETNAME`` (a configured name) and ``SELECT 0`` (an
    explicit database) when they connect; refused, the frontend cannot connect at all.
    Another database stays refused: nothing is served there."""
    url = redis_server.url.replace("redis://", "redis://frontend-web:s3cret-pw@")
    for line in frontend_acl("web", "s3cret-pw"):
        await real_redis.execute_command(*line.split())
    named = aioredis.from_url(url, client_name="gateway-replica-1", decode_responses=True)
    try:
        assert await named.execute_command("SELECT", "0")
        with pytest.raises(NoPermissionError):
            await named.execute_command("SELECT", "1")
        msg = InboundMessage(channel="web", sender_id="u", chat_id="n", content="hi")
        assert await FrontendClient(named).send(msg)
        assert "gateway-replica-1" in await real_redis.execute_command("CLIENT", "LIST")
    finally:
        await named.aclose()
        await real_redis.execute_command("ACL", "DELUSER", "frontend-web")
