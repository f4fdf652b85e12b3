"""The Lua scripts on fakeredis and on a real redis-server: loading, fencing, idempotency,
the release-vs-new-message race."""

from __future__ import annotations

import redis.asyncio as aioredis

from bus_redis import FrontendClient, InboundMessage, RedisBus
from bus_redis.results import Acquired, Busy, CommitSpec, Entry, Forward, Lost, More, Released
from bus_redis.scripts import SCRIPT_NAMES, script_source

K = "web:s"


async def test_every_script_loads(redis: aioredis.Redis) -> None:
    for name in SCRIPT_NAMES:
        sha = await redis.script_load(script_source(name))
        assert len(sha) == 40


async def _queued(redis: aioredis.Redis, *texts: str) -> RedisBus:
    client = FrontendClient(redis)
    for t in texts:
        await client.send(InboundMessage(channel="web", sender_id="u", chat_id="s", content=t))
    return RedisBus(redis, lock_ttl_ms=5000)


async def test_acquire_selects_then_commit_releases_when_empty(redis: aioredis.Redis) -> None:
    bus = await _queued(redis, "one")
    got = await bus.acquire(K, "w1", member=K)
    assert isinstance(got, Acquired)
    assert isinstance(got.step, Entry)
    assert isinstance(await bus.acquire(K, "w2", member=K), Busy)

    spec = CommitSpec(member=K, entry_ids=[got.step.entry_id], meta="{}", rows=['{"role":"user"}'])
    version, step = await bus.commit(K, got.token, "w1", spec, select=[K])
    assert version == 1
    assert isinstance(step, Released)
    assert not await redis.exists(bus.keys.lease(K), bus.keys.inbound(K), bus.keys.pending(K))


async def test_commit_is_idempotent_under_a_client_retry(redis: aioredis.Redis) -> None:
    bus = await _queued(redis, "one", "two")
    got = await bus.acquire(K, "w1", member=K)
    assert isinstance(got, Acquired)
    assert isinstance(got.step, Entry)
    spec = CommitSpec(
        member=K,
        entry_ids=[got.step.entry_id],
        meta="{}",
        rows=['{"r":1}'],
        reply='{"x":1}',
        reply_channel="web",
    )
    await bus.commit(K, got.token, "w1", spec, select=None)
    await bus.commit(K, got.token, "w1", spec, select=None)  # the retry

    assert await redis.hget(bus.keys.session(K), "count") == "1"
    assert await redis.xlen(bus.keys.out("web")) == 1
    assert await redis.xlen(bus.keys.inbound(K)) == 1  # "two" is still queued


async def test_a_stale_token_writes_nothing(redis: aioredis.Redis) -> None:
    bus = await _queued(redis, "one")
    got = await bus.acquire(K, "w1", member=K)
    assert isinstance(got, Acquired)
    assert isinstance(got.step, Entry)
    await redis.delete(bus.keys.lease(K))  # the lease expired
    again = await bus.acquire(K, "w2", member=K)
    assert isinstance(again, Acquired)
    assert again.token != got.token

    spec = CommitSpec(
        member=K,
        entry_ids=[got.step.entry_id],
        meta="{}",
        rows=['{"r":1}'],
        reply="{}",
        reply_channel="web",
    )
    version, step = await bus.commit(K, got.token, "w1", spec, select=[K])
    assert (version, step) == (-1, Lost())
    assert not await bus.renew(K, got.token)
    assert not await bus.emit(K, got.token, "web", "{}")
    assert not await redis.exists(bus.keys.session(K), bus.keys.out("web"))
    assert await redis.xlen(bus.keys.inbound(K)) == 1


async def test_a_message_arriving_during_release_keeps_the_lease(redis: aioredis.Redis) -> None:
    bus = await _queued(redis, "one")
    got = await bus.acquire(K, "w1", member=K)
    assert isinstance(got, Acquired)
    assert isinstance(got.step, Entry)
    # another chat of the same effective key is notified while we work
    await FrontendClient(redis).send(
        InboundMessage(channel="web", sender_id="u", chat_id="t", content="x")
    )
    assert isinstance(await bus.acquire(K, "w2", member="web:t"), Busy)

    spec = CommitSpec(member=K, entry_ids=[got.step.entry_id])
    _, step = await bus.commit(K, got.token, "w1", spec, select=[K])
    assert step == More(("web:t",))
    step = await bus.next(K, got.token, [K, "web:t"])
    assert isinstance(step, Entry)
    assert step.member == "web:t"


async def test_transient_owner_gets_the_forward(redis: aioredis.Redis) -> None:
    bus = await _queued(redis, "private")
    got = await bus.acquire(K, "owner", member=K, claim_owner=True, select=False)
    assert isinstance(got, Acquired)
    assert await bus.release(K, got.token)
    assert await bus.acquire(K, "other", member=K) == Forward("owner")
    assert isinstance(await bus.acquire(K, "owner", member=K, claim_owner=True), Acquired)


async def test_replies_redeliver_what_a_named_consumer_never_acknowledged(
    redis: aioredis.Redis,
) -> None:
    import json

    client = FrontendClient(redis)
    out = RedisBus(redis).keys.out("web")
    for i in range(3):
        doc = {
            "v": 1,
            "type": "message",
            "channel": "web",
            "chat_id": "c",
            "session_key": "web:c",
            "reply_to": f"r{i}",
            "content": str(i),
        }
        await redis.xadd(out, {"payload": json.dumps(doc)})
    await redis.xadd(out, {"payload": "not json"})

    first = client.replies("web", group="g", consumer="gw-1", count=10)
    assert (await anext(first)).reply_to == "r0"
    await first.aclose()  # stops mid-batch: r0 (yielded) is acknowledged, r1 and r2 stay pending

    again = client.replies("web", group="g", consumer="gw-1", count=10)
    seen = [(await anext(again)).reply_to, (await anext(again)).reply_to]
    await again.aclose()
    assert seen == ["r1", "r2"]
    assert await redis.xlen(out) == 1  # only the malformed entry is left, pending
