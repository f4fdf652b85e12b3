"""The frontend ACL of docs/ACL.md, applied to a real redis-server: what it allows and refuses."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from helpers import ScriptedProvider
from redis.exceptions import NoPermissionError
from replies import collect

from bus_redis import FrontendClient, InboundMessage, Keys, RedisBus
from worker import AgentLoop, LoopConfig
from worker.providers import LLMResponse

pytestmark = pytest.mark.real_redis
DOC = Path(__file__).resolve().parents[1] / "docs" / "ACL.md"


def _acl_words() -> list[str]:
    block = re.search(r"```\n(ACL SETUSER.*?)```", DOC.read_text(), re.S)
    assert block is not None
    return block.group(1).replace(">CHANGE-ME", ">s3cret").split()


async def test_frontend_acl_allows_the_protocol_and_nothing_more(
    real_redis: aioredis.Redis, redis_server
) -> None:  # type: ignore[no-untyped-def]
    words = _acl_words()
    assert words[:2] == ["ACL", "SETUSER"]
    await real_redis.execute_command(*words)
    url = redis_server.url.replace("redis://", "redis://frontend-web:s3cret@")
    frontend_redis = aioredis.from_url(url, decode_responses=True)

    async def answer(**kw: object) -> LLMResponse:
        return LLMResponse(content="ok")

    loop = AgentLoop(
        RedisBus(real_redis), ScriptedProvider(handler=answer), config=LoopConfig(read_block_ms=100)
    )
    task = asyncio.create_task(loop.run())
    try:
        client = FrontendClient(frontend_redis)
        mid = await client.send(
            InboundMessage(id="a1", channel="web", sender_id="u", chat_id="1", content="hi")
        )
        _, opened = await client.open_transient("web", "2", session_key="web:2-private")
        got = await collect(client, "web", {mid, opened})
        assert got[mid][-1].content == "ok"
        assert await client.stop("web:1") >= 1

        keys = Keys()
        for forbidden in (
            frontend_redis.hgetall(keys.session("web:1")),
            frontend_redis.hget(keys.memory, "content"),
            frontend_redis.get(keys.lease("web:1")),
            frontend_redis.xrange(keys.dead),
            frontend_redis.xrange(keys.out("other-channel")),
            frontend_redis.xrange(keys.ready),
            frontend_redis.publish("somewhere-else", "x"),
        ):
            with pytest.raises(NoPermissionError):
                await forbidden
    finally:
        loop.stop()
        await asyncio.wait_for(task, 10)
        await frontend_redis.aclose()
        await real_redis.execute_command("ACL", "DELUSER", "frontend-web")
