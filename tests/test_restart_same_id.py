"""A worker killed -9 and restarted at once under its fixed ``AGENT_WORKER_ID`` (a pod
name): the former life's private sessions end at the start (a helper's attack, stop 51).
Before, their owner records named the id, so they never looked dead; the new life served
the key's durable message, and when the record ran out the loss report deleted that
answer with the private session's events. On a real redis-server, with real processes."""

from __future__ import annotations

import pytest
from replies import until


# --- (e) a worker restarted under its own AGENT_WORKER_ID -------------------------------
def _worker(url: str, worker_id: str) -> object:
    from workers import WorkerProcess

    return WorkerProcess(
        url,
        worker_id=worker_id,
        env={
            "AGENT_PROVIDER": "echo",
            "AGENT_JOBS": "local",
            "AGENT_CHANNELS": "web",
            # the owner record runs out 6 s after its owner died (15 s by default): the
            # loss is told sooner, the order of what happens is the same
            "AGENT_LOCK_TTL_MS": "1000",
            "AGENT_OWNER_TTL_MS": "6000",
        },
    )


@pytest.mark.real_redis
async def test_a_worker_restarted_under_its_id_ends_its_former_lifes_private_sessions(  # type: ignore[no-untyped-def]
    redis_server, real_redis
) -> None:
    """A fixed ``AGENT_WORKER_ID`` (a StatefulSet's pod name, a compose file's hostname)
    and a worker killed (OOM killer, kill -9) that its supervisor restarts at once: the
    start checks let it ("a crashed process of this host: restarting under its id is
    fine", registration.py) and hand its former life's *leases* and *jobs* over at start
    (ARCHITECTURE: "A worker restarted under the same id hands its former life's leases
    over at start"). Its former life's *private sessions* are not ended: their owner
    records name the id, which beats again, so liveness never judges their owner dead,
    and the new life (owner == its own id in acquire.lua) serves the key as if nothing
    were open there. A durable message on the key is then answered, and when the owner
    record runs out the loss of the private session deletes the key's event stream,
    that durable message's answer with it: a frontend that had not read it yet never
    gets it (README: every inbound message gets exactly one terminal event); the
    ``session_lost`` notice comes after answers the new life gave on the key.

    Expected: the private session ends when its worker's new life starts (as a dead
    owner's does when liveness notices it): its ``session_lost`` notice comes before
    anything the new life answers on the key, and no later answer is deleted."""

    from bus_redis import FrontendClient, InboundMessage, Keys

    url = redis_server.url
    client = FrontendClient(real_redis)
    out = Keys().out("web:p")
    first = _worker(url, "fixed-id")
    second = None
    try:
        _, opened = await client.open_transient("web", "p", session_key="web:p")
        await until(lambda: _has_reply(real_redis, out, opened), timeout_s=30)
        private = InboundMessage(
            channel="web", chat_id="p", sender_id="u", content="private text",
            session_key_override="web:p", require_existing_session=True,
        )  # fmt: skip
        answer = await client.ask(private, timeout_s=30)
        assert answer.type == "message"
        first.kill()  # type: ignore[attr-defined]
        second = _worker(url, "fixed-id")  # restarted at once, under the same id

        durable = InboundMessage(channel="web", chat_id="p", sender_id="u", content="durable")
        answer = await client.ask(durable, timeout_s=30)
        assert answer.type == "message", answer
        # the private session's loss is told (at once, or once its owner record ran out)
        await until(lambda: _has_code(real_redis, out, "session_lost"), timeout_s=30)
        kept = [_doc(fields) for _, fields in await real_redis.xrange(out)]
        assert any(d.get("reply_to") == durable.id or d.get("reply_to") == answer.reply_to
                   for d in kept if d.get("type") == "message"), (
            "the durable message's answer was deleted with the private session's events",
            kept,
        )  # fmt: skip
    finally:
        first.close()  # type: ignore[attr-defined]
        if second is not None:
            print(second.log()[-3000:])  # type: ignore[attr-defined]
            second.close()  # type: ignore[attr-defined]


def _doc(fields: dict[str, str]) -> dict[str, object]:
    import json

    try:
        doc = json.loads(fields.get("payload", ""))
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


async def _has_reply(redis, stream: str, reply_to: str) -> bool:  # type: ignore[no-untyped-def]
    return any(_doc(f).get("reply_to") == reply_to for _, f in await redis.xrange(stream))


async def _has_code(redis, stream: str, code: str) -> bool:  # type: ignore[no-untyped-def]
    return any(_doc(f).get("code") == code for _, f in await redis.xrange(stream))


async def test_a_worker_whose_id_another_claimed_stops_its_tick_and_leaves_the_id_alone(  # type: ignore[no-untyped-def]
    redis,
) -> None:
    """Another process claimed this worker's id while it was stopped (SIGSTOP past its
    record, ``tests/test_kill_chaos.py``): its heartbeat finds the claim another's and it
    stops. The tick that found it went on (closing idle private sessions, renewing or
    dropping owner records, all by the id: the other's now) and later ticks ran during
    the drain (a second reading, stop 52); then the stop deregistered the id. Now no step
    runs after the heartbeat that found it, no later tick runs, and the id's record,
    inbox and beat are left to the other process; ``run()`` raises the conflict."""
    import asyncio

    from bus_redis import Keys, RedisBus
    from worker import AgentLoop, LoopConfig
    from worker.agent.providers import EchoProvider
    from worker.runtime.registration import WorkerConflictError

    k = Keys()
    loop = AgentLoop(RedisBus(redis), EchoProvider(), config=LoopConfig(worker_id="twin"))
    task = asyncio.create_task(loop.run())
    await until(lambda: bool(loop.rt.claim))
    steps: list[str] = []

    async def close_idle() -> None:
        steps.append("close_idle")

    loop.maintenance.close_idle = close_idle  # type: ignore[method-assign]
    await redis.hset(k.worker_info("twin"), mapping={"claim": "other", "host": "h2", "pid": "9"})
    await redis.xadd(k.inbox("twin"), {"session": "web:x"})  # (the other's inbox)
    await loop.maintenance.tick()
    assert steps == [], "a step ran after the heartbeat found the id another's"
    with pytest.raises(WorkerConflictError, match="claimed by pid 9 on h2"):
        await asyncio.wait_for(task, 15)
    await loop.maintenance.tick()  # (none runs any more)
    assert steps == []
    info = await redis.hgetall(k.worker_info("twin"))
    assert (info.get("claim"), info.get("pid")) == ("other", "9")
    assert await redis.exists(k.inbox("twin"))
