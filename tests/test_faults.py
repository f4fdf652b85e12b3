"""Faults on purpose: a paused zombie, SIGTERM drain, Redis restart, a dead transient owner."""

from __future__ import annotations

import asyncio
import json
import signal

import pytest
import redis.asyncio as aioredis
from replies import channel_events, collect, wait_until_async
from servers import RedisServer

from bus_redis import FrontendClient, InboundMessage, Keys

pytestmark = [pytest.mark.real_redis, pytest.mark.slow]
FAST = {"AGENT_LOCK_TTL_MS": "1000", "AGENT_OWNER_TTL_MS": "1000"}


def _m(chat: str, text: str, **kw: object) -> InboundMessage:
    return InboundMessage(
        id=f"{chat}:{text}", channel="web", sender_id="u", chat_id=chat, content=text, **kw
    )  # type: ignore[arg-type]


async def _holder(redis: aioredis.Redis, key: str) -> str:
    return str(await redis.get(Keys().lease(key))).split("|", 1)[1]


async def test_paused_zombie_cannot_write_after_losing_its_lease(
    real_redis, spawn_workers, fake_llm
) -> None:  # type: ignore[no-untyped-def]
    workers = {w.worker_id: w for w in spawn_workers(2, env=FAST)}
    client = FrontendClient(real_redis)
    mid = await client.send(_m("z", "block zombie"))
    assert await asyncio.to_thread(fake_llm.started.wait, 20)
    zombie = workers[await _holder(real_redis, "web:z")]

    zombie.signal(signal.SIGSTOP)  # longer than the TTL: the other worker takes over
    fake_llm.release()
    got = await collect(client, "web", {mid}, timeout_s=20)
    zombie.signal(signal.SIGCONT)
    follow = await client.send(_m("z", "after"))
    got.update(await collect(client, "web", {follow}, timeout_s=20))

    assert [ev.metadata.get("worker") for ev in got[mid] if ev.is_terminal] != [zombie.worker_id]
    assert sum(ev.is_terminal for ev in got[mid]) == 1
    h = await real_redis.hgetall(Keys().session("web:z"))
    assert h["count"] == "4"  # one pair per message, the zombie's late turn wrote nothing
    info_key = Keys().worker_info(zombie.worker_id)

    async def zombie_noticed() -> bool:  # counted in the zombie's own heartbeat
        info = await real_redis.hgetall(info_key)
        return int(info.get("leases_lost", 0)) + int(info.get("fenced_writes_rejected", 0)) >= 1

    assert await wait_until_async(zombie_noticed, timeout_s=10)


async def test_sigterm_finishes_running_turn_and_exits_zero(
    real_redis, spawn_workers, fake_llm
) -> None:  # type: ignore[no-untyped-def]
    (worker,) = spawn_workers(1, env={"AGENT_SHUTDOWN_GRACE_S": "20"})
    client = FrontendClient(real_redis)
    mid = await client.send(_m("t", "block drain"))
    assert await asyncio.to_thread(fake_llm.started.wait, 20)

    worker.signal(signal.SIGTERM)
    fake_llm.release()
    got = await collect(client, "web", {mid}, timeout_s=20)

    assert got[mid][-1].type == "message"
    assert await asyncio.to_thread(worker.proc.wait, 20) == 0


async def test_sigterm_past_grace_releases_the_lease_at_once(
    real_redis, spawn_workers, fake_llm
) -> None:  # type: ignore[no-untyped-def]
    slow_ttl = {"AGENT_LOCK_TTL_MS": "60000", "AGENT_SHUTDOWN_GRACE_S": "0.2"}
    (first,) = spawn_workers(1, env=slow_ttl)
    client = FrontendClient(real_redis)
    mid = await client.send(_m("g", "block grace"))
    assert await asyncio.to_thread(fake_llm.started.wait, 20)
    spawn_workers(1, env=slow_ttl)

    first.signal(signal.SIGTERM)
    assert await asyncio.to_thread(first.proc.wait, 20) == 0
    fake_llm.release()
    got = await collect(client, "web", {mid}, timeout_s=15)  # far less than the 60 s lease

    assert [ev.type for ev in got[mid] if ev.is_terminal] == ["message"]
    assert got[mid][-1].metadata["worker"] != first.worker_id


async def test_redis_restart_with_aof_loses_nothing(spawn_workers, fake_llm) -> None:  # type: ignore[no-untyped-def]
    server = RedisServer(aof=True).start()
    try:
        spawn_workers(2, env=FAST, url=server.url)
        redis = aioredis.from_url(server.url, decode_responses=True)
        client = FrontendClient(redis)
        before = {await client.send(_m(f"r{i}", "before")) for i in range(5)}
        await collect(client, "web", before, timeout_s=20)
        pending = {await client.send(_m(f"r{i}", "queued")) for i in range(5)}
        await redis.aclose()

        server.stop()
        server.start()  # same port, same AOF

        redis = aioredis.from_url(server.url, decode_responses=True)
        client = FrontendClient(redis)
        after = {await client.send(_m(f"r{i}", "after")) for i in range(5)}
        got = await collect(client, "web", pending | after, timeout_s=40)
        assert all(sum(ev.is_terminal for ev in got[i]) == 1 for i in pending | after)
        for i in range(5):
            assert (await redis.hgetall(Keys().session(f"web:r{i}")))["count"] == "6"
        await redis.aclose()
    finally:
        server.cleanup()


async def test_dead_transient_owner_is_reported_and_fails_closed(
    real_redis, spawn_workers, fake_llm
) -> None:  # type: ignore[no-untyped-def]
    (owner,) = spawn_workers(1, env=FAST)
    client = FrontendClient(real_redis)
    key, opened = await client.open_transient("web", "p", session_key="web:p-private")
    await collect(client, "web", {opened})
    spawn_workers(1, env=FAST)

    owner.kill()
    lost = await _first_event(client, code="session_lost")
    mid = await client.send(
        _m("p", "anyone?", session_key_override=key, require_existing_session=True)
    )
    got = await collect(client, "web", {mid}, timeout_s=20)

    assert lost.session_key == key
    assert got[mid][-1].code == "session_not_active"
    assert fake_llm.requests == []
    assert not await real_redis.exists(Keys().session(key))


async def _first_event(client: FrontendClient, *, code: str):  # type: ignore[no-untyped-def]
    async def read():  # type: ignore[no-untyped-def]
        while True:
            for ev in await channel_events(client, "web"):
                if ev.code == code:
                    return ev
            await asyncio.sleep(0.05)  # poll: the event comes from another process

    return await asyncio.wait_for(read(), 20)


async def test_killing_the_turn_connection_loses_and_doubles_nothing(
    real_redis, spawn_workers, fake_llm
) -> None:  # type: ignore[no-untyped-def]
    """A careless operator's ``CLIENT KILL`` of the worker's turn-path connection (the one
    every script shares, bus_redis.mux) while messages flow: commands waiting on it fail,
    the worker connects again; every message is answered once and stored once."""
    spawn_workers(1, env=FAST)
    client = FrontendClient(real_redis)
    await collect(client, "web", {await client.send(_m("warm", "up"))}, timeout_s=30)
    sent: set[str] = set()
    killed = 0
    for i in range(40):
        sent.add(await client.send(_m(f"k{i % 8}", f"m{i}")))
        for c in await real_redis.client_list():
            if c["cmd"] in ("evalsha", "eval", "xrange", "hmget"):  # the worker's scripts
                killed += int(await real_redis.client_kill_filter(_id=c["id"]))
    got = await collect(client, "web", sent, timeout_s=60)

    assert killed > 0
    assert all(sum(ev.is_terminal for ev in got[m]) == 1 for m in sent)
    answered = [  # a reply names every message it answers (several: joined mid-turn)
        m
        for ev in await channel_events(client, "web")
        if ev.is_terminal and ev.session_key != "web:warm"
        for m in (ev.covers or [ev.reply_to])
    ]
    assert sorted(answered) == sorted(sent)  # each once
    for s in range(8):  # five messages each, stored once each
        stored = await real_redis.hgetall(Keys().session(f"web:k{s}"))
        rows = [json.loads(stored[f"m:{i}"]) for i in range(int(stored["count"]))]
        users = sorted(r["message_id"] for r in rows if r["role"] == "user")
        assert users == sorted(m for m in sent if m.startswith(f"k{s}:"))
