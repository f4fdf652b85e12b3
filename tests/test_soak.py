"""Soak: 1,000 sessions (durable, private then discarded, junk) through two real worker
processes and a graceful stop. Afterwards Redis holds the durable sessions and their
indexes, and otherwise only a bounded number of keys, each with an expiry where it is per
session or per worker; the workers' in-memory tables were empty before they stopped."""

from __future__ import annotations

import asyncio
import json

import pytest
import redis.asyncio as aioredis
from replies import TEST_CHANNELS, collect, wait_until_async

from bus_redis import FrontendClient, InboundMessage, Keys

pytestmark = [pytest.mark.real_redis, pytest.mark.slow]
DURABLE, PRIVATE, JUNK = 600, 200, 200


async def _private(client: FrontendClient, i: int) -> None:
    key, _ = await client.open_transient("web", f"p{i}", session_key=f"web:p{i}-private")
    msg = InboundMessage(
        channel="web", sender_id="u", chat_id=f"p{i}", content=f"private {i}",
        session_key_override=key, require_existing_session=True,
    )  # fmt: skip
    answer = await client.ask(msg, timeout_s=60)
    assert answer.content == f"re: private {i}"
    await client.discard(key)


async def test_a_thousand_sessions_leave_nothing_behind(
    real_redis: aioredis.Redis, spawn_workers
) -> None:  # type: ignore[no-untyped-def]
    workers = spawn_workers(2, env={"AGENT_SWEEP_INTERVAL_MS": "200", "AGENT_LOCK_TTL_MS": "1500"})
    client = FrontendClient(real_redis)
    k = Keys()
    durable = [
        await client.send(InboundMessage(id=f"d{i}", channel="web", sender_id="u", chat_id=f"d{i}", content=f"durable {i}"))
        for i in range(DURABLE)
    ]  # fmt: skip
    junk = []
    for i in range(JUNK):  # a payload naming another channel, and a forged notification
        doc = {"v": 2, "id": f"j{i}", "channel": f"junk{i}", "sender_id": "u", "chat_id": "x"}
        await client.send_raw(f"web:j{i}", json.dumps(doc))
        junk.append(f"j{i}")  # answered under its id
        await real_redis.xadd(k.ready("web"), {"session": f"junk{i}:x"})
    for start in range(0, PRIVATE, 20):  # each: open, ask (reads and deletes), discard
        await asyncio.gather(*(_private(client, i) for i in range(start, start + 20)))
    got = await collect(client, "web", {*durable, *junk}, timeout_s=120)
    assert all(got[d][-1].type == "message" for d in durable)
    assert {got[j][-1].code for j in junk} == {"invalid_message"}

    async def idle() -> bool:  # every worker's in-memory tables are empty
        infos = [await real_redis.hgetall(k.worker_info(w.worker_id)) for w in workers]
        return all(i.get("active") == "0" and i.get("transient") == "0" for i in infos)

    assert await wait_until_async(idle, timeout_s=20)
    for w in workers:
        assert w.terminate() == 0  # graceful stop

    left = {key: (await real_redis.type(key), await real_redis.pttl(key)) async for key in real_redis.scan_iter(count=1000)}  # fmt: skip
    durable_keys = {k.session(f"web:d{i}") for i in range(DURABLE)}
    assert durable_keys <= set(left)
    indexes = {k.sessions_index("web"), k.scope_sessions("web/sender:u"), k.channels}
    rest = {key: v for key, v in left.items() if key not in durable_keys | indexes}
    forbidden = [key for key in rest if any(part in key for part in (
        ":in:", ":lease:", ":pending:", ":attempts:", ":ctl:", ":owner:", ":worker:", "junk"))]  # fmt: skip
    assert forbidden == []
    assert k.workers not in rest
    per_session = [key for key in rest if ":out:" in key]
    assert all(ttl != -1 for key, (_t, ttl) in rest.items() if key in per_session)  # -2: gone
    for key in per_session:  # private sessions' events were deleted once delivered
        if "-private" in key:
            kept = [f["payload"] for _, f in await real_redis.xrange(key)]
            assert all("re: private" not in p for p in kept), kept
    per_channel = {k.ready(c) for c in TEST_CHANNELS} | {k.dead("web")}  # bounded by MAXLEN
    per_channel |= {k.pulse(c) for c in TEST_CHANNELS}  # stream names only, MAXLEN ~10,000
    for key in {k.pulse(c) for c in TEST_CHANNELS} & set(rest):  # no text of any session
        assert all(set(f) == {"o"} for _, f in await real_redis.xrange(key))
    per_channel |= {f"{k.prefix}:mode", k.discovery}  # one each per deployment
    # PTTL -1: no expiry; -2: gone since the scan (the sweeper's 200 ms claim, say)
    unbounded = [key for key, (_t, ttl) in rest.items() if ttl == -1 and key not in per_session]
    assert set(unbounded) <= per_channel, unbounded
    consumers = await real_redis.xinfo_consumers(k.ready("web"), "workers")
    assert consumers == []  # the graceful stop removed them
    assert await real_redis.xlen(k.ready("web")) == 0
