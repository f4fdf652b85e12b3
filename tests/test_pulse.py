"""Event pulses (``bus_redis.pulse``): a frontend following many sessions blocks on its
channel's pulse alone and reads only the streams it names; a pulse trimmed past a
reader's position makes it read every followed stream once. On fakeredis and a real
redis-server."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as aioredis
from helpers import ScriptedProvider

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
