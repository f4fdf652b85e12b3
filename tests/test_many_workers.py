"""Several real worker processes: per-session order, no overlap, exactly one answer each;
kill -9 in the middle of a run loses nothing."""

from __future__ import annotations

import asyncio
import json

import pytest
import redis.asyncio as aioredis
from replies import collect, wait_until_async

from bus_redis import FrontendClient, InboundMessage, Keys

pytestmark = [pytest.mark.real_redis, pytest.mark.slow]
# queue: one turn (and one answer) per message, so that order and exactly-once show per
# message (inject would let a burst join one turn: tests/test_tools.py covers that)
QUEUE = {"AGENT_FOLLOWUP_MODE": "queue"}
FAST = {"AGENT_LOCK_TTL_MS": "1000", "AGENT_OWNER_TTL_MS": "1000", **QUEUE}


def _m(session: int, n: int) -> InboundMessage:
    return InboundMessage(
        id=f"s{session}-m{n}",
        channel="web",
        sender_id="u",
        chat_id=f"c{session}",
        content=f"[s{session}] m{n}",
    )


async def _publish_all(client: FrontendClient, sessions: int, per: int) -> set[str]:
    ids = set()
    for n in range(per):
        for s in range(sessions):
            ids.add(await client.send(_m(s, n)))
    return ids


async def _assert_histories(redis: aioredis.Redis, sessions: int, per: int) -> None:
    for s in range(sessions):
        h = await redis.hgetall(Keys().session(f"web:c{s}"))
        rows = [json.loads(h[f"m:{i}"]) for i in range(int(h["count"]))]
        users = [r["content"] for r in rows if r["role"] == "user"]
        assert users == [f"[s{s}] m{n}" for n in range(per)]  # publish order, each once
        assert len(rows) == 2 * per


async def test_order_no_overlap_exactly_once(real_redis, spawn_workers, fake_llm) -> None:  # type: ignore[no-untyped-def]
    fake_llm.latency_s = (0.0, 0.03)
    workers = spawn_workers(3, env={"AGENT_CONCURRENCY": "8", **QUEUE})
    client = FrontendClient(real_redis)

    async def all_up() -> bool:  # every worker serves before the load arrives
        infos = [await real_redis.hget(Keys().worker_info(w.worker_id), "pid") for w in workers]
        return all(infos)

    assert await wait_until_async(all_up, timeout_s=20)
    ids = await _publish_all(client, sessions=24, per=4)

    got = await collect(client, "web", ids, timeout_s=60)

    assert all(sum(ev.is_terminal for ev in got[i]) == 1 for i in ids)
    assert all(got[i][-1].type == "message" for i in ids), [
        got[i][-1] for i in ids if got[i][-1].type != "message"
    ]
    assert fake_llm.overlaps == 0
    await _assert_histories(real_redis, 24, 4)
    workers_used = {ev.metadata.get("worker") for i in ids for ev in got[i]}
    assert len(workers_used) >= 2  # the load was shared


async def test_kill9_midway_loses_nothing(real_redis, spawn_workers, fake_llm) -> None:  # type: ignore[no-untyped-def]
    fake_llm.latency_s = (0.02, 0.06)
    victim, _other = spawn_workers(2, env=FAST)
    client = FrontendClient(real_redis)
    ids = await _publish_all(client, sessions=10, per=4)
    first = await collect(client, "web", {"s0-m0"}, timeout_s=30)  # work is under way
    assert first["s0-m0"][-1].type == "message"

    victim.kill()
    spawn_workers(1, env=FAST)
    got = await collect(client, "web", ids - {"s0-m0"}, timeout_s=60)

    got.update(first)
    assert all(sum(ev.is_terminal for ev in got[i]) == 1 for i in ids)
    await _assert_histories(real_redis, 10, 4)


async def test_kill9_during_llm_call_fails_over_after_the_lease(
    real_redis, spawn_workers, fake_llm
) -> None:  # type: ignore[no-untyped-def]
    workers = {w.worker_id: w for w in spawn_workers(2, env=FAST)}
    client = FrontendClient(real_redis)
    mid = await client.send(
        InboundMessage(id="blk", channel="web", sender_id="u", chat_id="k", content="block me")
    )
    assert await asyncio.to_thread(fake_llm.started.wait, 20)
    holder = (await real_redis.get(Keys().lease("web:k"))).split("|", 1)[1]

    workers[holder].kill()
    fake_llm.release()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    got = await collect(client, "web", {mid}, timeout_s=20)
    failover_s = loop.time() - t0

    assert [ev.type for ev in got[mid] if ev.is_terminal] == ["message"]
    assert got[mid][-1].metadata["worker"] != holder
    h = await real_redis.hgetall(Keys().session("web:k"))
    assert h["count"] == "2"
    print(f"failover after kill -9: {failover_s * 1000:.0f} ms (lease TTL 1000 ms)")


@pytest.mark.parametrize("point", ["after_read", "after_acquire", "before_commit", "after_commit"])
async def test_kill_at_each_step_answers_once(
    real_redis, spawn_workers, fake_llm, point: str
) -> None:  # type: ignore[no-untyped-def]
    (doomed,) = spawn_workers(1, env={**FAST, "AGENT_FAULT_POINTS": point})
    client = FrontendClient(real_redis)
    mid = await client.send(_m(0, 0))
    assert await asyncio.to_thread(doomed.proc.wait, 20) == 137  # died exactly there
    spawn_workers(1, env=FAST)
    later = await client.send(_m(0, 1))

    got = await collect(client, "web", {mid, later}, timeout_s=20)

    assert [sum(ev.is_terminal for ev in got[i]) for i in (mid, later)] == [1, 1]
    await _assert_histories(real_redis, 1, 2)


async def test_unified_mode_serialises_many_chats_across_workers(
    real_redis, spawn_workers, fake_llm
) -> None:  # type: ignore[no-untyped-def]
    fake_llm.latency_s = (0.0, 0.02)
    spawn_workers(3, env={"AGENT_UNIFIED_SESSION": "1", **QUEUE})
    client = FrontendClient(real_redis)
    ids = set()
    for n in range(3):
        for chat in range(5):
            msg = InboundMessage(
                id=f"u{chat}-{n}",
                channel="web",
                sender_id="u",
                chat_id=f"u{chat}",
                content=f"[unified] c{chat} m{n}",
            )
            ids.add(await client.send(msg))

    got = await collect(client, "web", ids, timeout_s=60)

    assert all(sum(ev.is_terminal for ev in got[i]) == 1 for i in ids)
    assert fake_llm.overlaps == 0  # one session: never two LLM calls at once
    h = await real_redis.hgetall(Keys().session("unified:default"))
    users = [
        json.loads(h[f"m:{i}"])["content"]
        for i in range(int(h["count"]))
        if '"user"' in h[f"m:{i}"]
    ]
    assert len(users) == 15
    for chat in range(5):  # each chat's messages in publish order
        mine = [u for u in users if u.startswith(f"[unified] c{chat} ")]
        assert mine == [f"[unified] c{chat} m{n}" for n in range(3)]
