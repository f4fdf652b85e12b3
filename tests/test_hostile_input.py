"""Hypothesis-generated hostile payloads (JSON-ish documents, text, arbitrary bytes that
are not UTF-8) through the wire: the worker survives, and every entry of the stream gets
exactly one terminal event on its session's event stream, in order."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import fakeredis
import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bus_redis import FrontendClient, Keys, RedisBus
from worker import AgentLoop, LoopConfig
from worker.agent.providers import EchoProvider

JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "v": st.sampled_from([2, 2, 1, "2", None]),
        "id": st.text(max_size=10) | st.integers(),
        "channel": st.sampled_from(["web", "", "we{b}", 3]),
        "sender_id": st.sampled_from(["u", "", None]),
        "chat_id": st.sampled_from(["h", "h\x00", "%7B", ""]),
        "content": st.text(max_size=50) | JSONISH,
        "metadata": st.dictionaries(
            st.sampled_from(["_runtime_control", "_user_shell", "lang"]), JSONISH
        ),
        "session_key_override": st.sampled_from([None, "web:h", "", "x{y}", "telegram:a"]),
        "require_existing_session": st.booleans() | st.just("yes"),
        "input_role": st.sampled_from(["user", "system", "admin", None]),
        "op": st.sampled_from(["discard", "stop", "open_transient"]),
        "media": JSONISH,
    },
)
PAYLOADS = st.one_of(
    FIELDS.map(json.dumps),
    st.text(max_size=60),
    st.binary(max_size=40),
    FIELDS.map(lambda d: json.dumps(d).encode().replace(b'"h"', b'"h\xff\xfe"')),
)


def _fake() -> Callable[[], aioredis.Redis]:
    server = fakeredis.FakeServer()
    return lambda: fakeredis.FakeAsyncRedis(server=server, decode_responses=True)


def _client_id(raw: str | bytes) -> str | None:
    """The ``id`` a payload carries (what its answer names), if any."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    value = doc.get("id") if isinstance(doc, dict) else None
    return value if isinstance(value, str) and value else None


async def _run(payloads: list[str | bytes], make: Callable[[], aioredis.Redis]) -> None:
    worker_redis = make()
    await worker_redis.flushall()
    await worker_redis.sadd(Keys().channels, "web")
    loop = AgentLoop(
        RedisBus(worker_redis),
        EchoProvider(),
        config=LoopConfig(read_block_ms=50, max_payload_bytes=2048),
    )
    client = FrontendClient(make())
    task = asyncio.create_task(loop.run())
    entry_ids = [await client.send_raw("web:h", raw) for raw in payloads]
    canary_doc = {"v": 2, "channel": "web", "sender_id": "u", "chat_id": "h", "content": "canary"}
    canary = await client.send_raw("web:h", json.dumps(canary_doc))

    terminal: list[tuple[str, str]] = []  # (reply_to, code or type)

    async def wait_canary() -> None:
        async for ev in client.events(["web:h"], after="0"):
            if ev.is_terminal:
                terminal.append((ev.reply_to or "", ev.code or ev.type))
            if ev.reply_to == canary:
                return

    await asyncio.wait_for(wait_canary(), 20)
    loop.stop()
    await asyncio.wait_for(task, 10)
    redis = client.redis
    assert len(terminal) == len(payloads) + 1  # one terminal event per entry, none lost
    for (reply_to, _), raw, entry_id in zip(terminal, payloads, entry_ids, strict=False):
        assert reply_to in (entry_id, _client_id(raw)), (reply_to, raw)  # in order, its own
    assert await redis.xlen(Keys().inbound("web:h")) == 0  # nothing left behind
    assert await redis.xlen(Keys().dead("web")) <= len(payloads)
    assert not [k async for k in redis.scan_iter(match="agent:{telegram}*")]  # never served
    assert loop.active_tasks == {}
    assert loop.turns.empty()
    await client.redis.aclose()
    await worker_redis.aclose()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(PAYLOADS, min_size=1, max_size=6))
def test_hostile_payloads_never_stop_the_worker(payloads: list[str | bytes]) -> None:
    asyncio.run(_run(payloads, _fake()))


@pytest.mark.real_redis
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payloads=st.lists(PAYLOADS, min_size=1, max_size=6))
def test_hostile_payloads_on_a_real_server(redis_server, payloads: list[str | bytes]) -> None:  # type: ignore[no-untyped-def]
    asyncio.run(_run(payloads, lambda: aioredis.from_url(redis_server.url, decode_responses=True)))
