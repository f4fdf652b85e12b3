"""Event pulses (``bus_redis.pulse``): a frontend following many sessions blocks on its
channel's pulse alone and reads only the streams it names; a pulse trimmed past a
reader's position makes it read every followed stream once. On fakeredis and a real
redis-server."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as aioredis

from bus_redis import FrontendClient, InboundMessage, Keys, OutboundMessage
from bus_redis.pulse import PulseWatch

K = Keys()


@pytest.mark.frontend
async def test_a_pulse_names_the_streams_that_got_events(redis: aioredis.Redis) -> None:
    watch = PulseWatch(redis, K, batch=100)
    await watch.add_channels(["web"])
    await redis.xadd(K.pulse("web"), {"o": K.out("web:a")})
    await redis.xadd(K.pulse("web"), {"o": K.out("web:b")})
    named, _ = await watch.wait(100)
    assert named == {K.out("web:a"), K.out("web:b")}
    named, _ = await watch.wait(10)  # nothing new
    assert named == set()


@pytest.mark.frontend
async def test_a_pulse_trimmed_past_the_reader_means_read_everything(redis: aioredis.Redis) -> None:
    watch = PulseWatch(redis, K, batch=2)
    await watch.add_channels(["web"])
    await redis.xadd(K.pulse("web"), {"o": K.out("web:a")})
    named, _ = await watch.wait(10)
    assert named == {K.out("web:a")}
    for chat in "bcdef":  # the reader is away; the pulse keeps only the newest two
        await redis.xadd(K.pulse("web"), {"o": K.out(f"web:{chat}")})
    await redis.xtrim(K.pulse("web"), maxlen=2, approximate=False)
    named, _ = await watch.wait(10)
    assert named is None  # web:b..d were named in trimmed pulses: read every followed stream


async def test_following_many_sessions_blocks_on_one_key(redis, make_loop) -> None:  # type: ignore[no-untyped-def]
    """200 sessions followed by one iterator: every blocking read names the pulse alone,
    and each session's answer arrives once."""

    from helpers import ScriptedProvider  # the worker's side: not in the frontend venv

    async def echo(**kw: Any) -> Any:
        from worker.agent.providers import LLMResponse

        return LLMResponse(content=f"re: {kw['messages'][-1]['content']}")

    make_loop(ScriptedProvider(handler=echo))
    client = FrontendClient(redis)
    blocking: list[int] = []
    xread = redis.xread

    async def spy(streams: dict[Any, Any], *args: Any, **kw: Any) -> Any:
        if kw.get("block") is not None:
            blocking.append(len(streams))
        return await xread(streams, *args, **kw)

    redis.xread = spy  # type: ignore[method-assign]
    chats = [f"web:p{i}" for i in range(200)]
    got: dict[str, OutboundMessage] = {}

    async def follow() -> None:
        async for ev in client.events(chats, after="0", block_ms=200):
            assert ev.session_key not in got  # once
            got[ev.session_key] = ev
            if len(got) == len(chats):
                return

    reader = asyncio.create_task(follow())
    for key in chats:
        chat = key.partition(":")[2]
        await client.send(InboundMessage(channel="web", chat_id=chat, sender_id="u", content=chat))
    await asyncio.wait_for(reader, 30)
    assert {ev.content for ev in got.values()} == {f"re: p{i}" for i in range(200)}
    assert blocking
    assert set(blocking) == {1}  # the pulse, never the 200 streams


@pytest.mark.real_redis
@pytest.mark.frontend
async def test_a_frontend_user_without_the_pulse_grant_still_gets_its_events(
    real_redis, redis_server
) -> None:  # type: ignore[no-untyped-def]
    """ACL lines from before pulses (no read of P:{C}:pulse): events() over many sessions
    falls back to blocking on every followed stream, with a warning, and loses nothing."""
    from bus_redis.acl import frontend_acl

    setuser, *_ = frontend_acl("web", "old-acl-pw1")
    old = setuser.replace(f"(+xread +xrevrange +xrange ~{K.pulse('web')}) ", "")
    assert old != setuser
    await real_redis.execute_command(*old.split())
    url = redis_server.url.replace("redis://", "redis://frontend-web:old-acl-pw1@")
    user = aioredis.from_url(url, decode_responses=True)
    client = FrontendClient(user)
    chats = [f"web:o{i}" for i in range(20)]
    got: list[str] = []

    async def follow() -> None:
        async for ev in client.events(chats, after="0", block_ms=100):
            got.append(ev.session_key)
            if len(got) == 3:
                return

    reader = asyncio.create_task(follow())
    for key in chats[:3]:
        doc = OutboundMessage(type="message", channel="web", chat_id=key[4:], session_key=key)
        await real_redis.xadd(K.out(key), {"payload": doc.model_dump_json()})
    await asyncio.wait_for(reader, 10)
    assert sorted(got) == chats[:3]
    await user.aclose()


async def test_a_pulse_key_of_another_type_is_replaced_by_the_next_event(
    redis: aioredis.Redis,
) -> None:
    from bus_redis import RedisBus  # a worker's bus (redis-py 5): not a frontend test

    bus = RedisBus(redis)
    await redis.set(K.pulse("web"), "junk")
    await redis.set(K.lease("web:x"), "n|w", px=10_000)
    assert await bus.emit("web:x", "n|w", "web:x", '{"v":2}', transient=False)
    assert await redis.type(K.pulse("web")) == "stream"
    [(_, fields)] = await redis.xrange(K.pulse("web"))
    assert fields == {"o": K.out("web:x")}
