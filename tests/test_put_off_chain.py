"""Results put off for a private session, a second reading (stop 50), on fakeredis and a
real redis-server: a survivor's delivery of a dead worker's put-off result ran under the
base job id whatever the count said, so its next put-off asked for its own running id,
was refused, and the chain ended; a put-off kept naming the dead worker, so the
survivor's own death lost it; and the channel's index dropped a session waiting longer
than an hour (its slot, and a survivor's way to find it)."""

from __future__ import annotations

import json
from typing import Any

import redis.asyncio as aioredis
from helpers import ScriptedProvider
from replies import until

import worker.jobs.subagent_results as results_mod
from bus_redis import Keys, RedisBus
from bus_redis.subagents import SubagentStore
from worker import AgentLoop

K = Keys()
CAPS = {"limit": 2, "channel_limit": 8, "scope": "web/u", "scope_limit": 2}


def _result(session: str, sid: str) -> str:
    chat = session.split(":", 1)[1]
    return json.dumps(
        {
            "v": 2,
            "id": f"spawn:{sid}",
            "channel": "web",
            "chat_id": chat,
            "sender_id": "subagent",
            "input_role": "system",
            "content": "found: 42",
            "metadata": {"subagent": sid, "from": "1-0"},
        }
    )


async def _waiting_on_a_private_session(
    redis: aioredis.Redis,
    session: str,
    sid: str,
    run: str,
    *,
    worker: str,
    caps: dict[str, Any] = CAPS,
) -> SubagentStore:
    """A subagent of ``session`` registered as running ``run`` on ``worker`` (its turn's
    lease let go), and a private session open on the key."""
    store = SubagentStore(RedisBus(redis))
    await redis.set(K.lease(session), "n|w", px=10_000)
    doc = json.dumps({"id": sid, "session": session, "state": "running", "worker": worker,
                      "run": run, "after": "1-0"})  # fmt: skip
    assert await store.add(session, "n|w", session, sid, doc, **caps) == 1
    await redis.delete(K.lease(session))
    await redis.set(K.owner(session), "private-owner")
    return store


async def _delivered(redis: aioredis.Redis, session: str, before: int, why: str) -> None:
    """The result is published in ``session``'s stream (its length passed ``before``)."""
    try:
        await until(lambda: _published(redis, session, before), timeout_s=5)
    except AssertionError:
        raise AssertionError(why) from None


async def _put_off_count(redis: aioredis.Redis, session: str, sid: str) -> int:
    raw = await redis.hget(K.spawned(session), sid)
    return 0 if raw is None else int(json.loads(raw).get("put_off") or 0)


async def test_a_dead_workers_put_off_result_survives_a_second_put_off(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, monkeypatch
) -> None:
    """Worker ``dead`` put a result off once (its in-process deferred job died with it).
    A survivor queues its delivery again (base job id) while the private session is still
    open: it is put off a second time. Once the private session has ended, the result must
    still be published into the stored chat. On the current code the second put-off
    enqueues the base id, the survivor's own running job: refused, nothing delivers it."""
    monkeypatch.setattr(results_mod, "PUT_OFF_S", 0.05)
    monkeypatch.setattr(results_mod, "PUT_OFF_MAX_S", 0.05)
    session, sid = "web:so", "s9"
    store = await _waiting_on_a_private_session(redis, session, sid, "r9", worker="dead")
    assert await store.finish(session, sid, _result(session, sid), run="r9") == -3
    assert await store.put_off(session, sid, _result(session, sid), "r9") == 1  # then died

    survivor = AgentLoop(RedisBus(redis), ScriptedProvider([]))
    try:
        assert await survivor.subagents.rerun_orphans("dead", {"web"}) == 1
        await until(lambda: _at_least(redis, session, sid, 2), timeout_s=10)
        await redis.delete(K.owner(session))  # the private session ended
        before = await redis.xlen(K.inbound(session))
        await _delivered(
            redis,
            session,
            before,
            "the put-off result was never delivered after the private session ended",
        )
    finally:
        await survivor.jobs.aclose()


async def _at_least(redis: aioredis.Redis, session: str, sid: str, n: int) -> bool:
    return await _put_off_count(redis, session, sid) >= n


async def _published(redis: aioredis.Redis, session: str, before: int) -> bool:
    return await redis.xlen(K.inbound(session)) > before


async def test_a_survivors_put_off_delivery_is_not_lost_when_the_survivor_dies(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, monkeypatch
) -> None:
    """Worker ``dead`` put a result off twice and died; survivor S queues its delivery
    again, meets the private session still open and puts it off a third time (its own
    in-process deferred job). S dies in turn before that job is due. The registration
    still names ``dead`` (``put_off`` keeps the worker), so a third worker that judges S
    dead finds nothing of S's to deliver: the result is never published, though the
    private session has ended (README: published once after it has ended)."""
    monkeypatch.setattr(results_mod, "PUT_OFF_S", 60.0)  # S's deferred job: not due soon
    monkeypatch.setattr(results_mod, "PUT_OFF_MAX_S", 60.0)
    session, sid = "web:sx", "s8"
    store = await _waiting_on_a_private_session(redis, session, sid, "r8", worker="dead")
    for _ in range(2):  # the base job, then its ":again": then ``dead`` died
        assert await store.put_off(session, sid, _result(session, sid), "r8") > 0

    survivor = AgentLoop(RedisBus(redis), ScriptedProvider([]))
    try:
        assert await survivor.subagents.rerun_orphans("dead", {"web"}) == 1
        await until(lambda: _at_least(redis, session, sid, 3), timeout_s=10)
    finally:
        await survivor.jobs.aclose()  # S dies: its deferred delivery with it
    await redis.delete(K.owner(session))  # the private session ended
    before = await redis.xlen(K.inbound(session))

    third = AgentLoop(RedisBus(redis), ScriptedProvider([]))
    try:
        await third.subagents.rerun_orphans(survivor.rt.worker_id, {"web"})
        await _delivered(
            redis,
            session,
            before,
            "the result S put off died with S: a worker judging S dead did not deliver it",
        )
    finally:
        await third.jobs.aclose()


async def _aged_an_hour(redis: aioredis.Redis, session: str) -> None:
    """The channel index's entry of ``session`` as it stands an hour after its spawn
    (``spawn_add`` scores it with the spawn's time and nothing renews that score, while
    every put-off renews the registration's own TTL): the passage of time, not a fault."""
    now_ms = int((await redis.time())[0]) * 1000
    await redis.zadd(K.subagents("web"), {session: now_ms - 3_600_001}, xx=True)


async def test_a_result_put_off_past_an_hour_keeps_its_channel_slot(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis,
) -> None:
    """ARCHITECTURE (bounds): "The registration keeps its slot meanwhile, so the bounds of
    running subagents also bound the results waiting". A result put off for an hour of
    private session is still registered (each put-off renews its TTL), but the channel
    index still scores the session with its spawn time: the next spawn anywhere in the
    channel prunes it as expired, and the channel's bound no longer counts it."""
    session, other = "web:sa", "web:sb"
    caps = CAPS | {"channel_limit": 1}
    store = await _waiting_on_a_private_session(redis, session, "s7", "r7", worker="w", caps=caps)
    await _aged_an_hour(redis, session)
    assert await store.finish(session, "s7", _result(session, "s7"), run="r7") == -3
    assert await store.put_off(session, "s7", _result(session, "s7"), "r7") == 1
    assert await redis.hexists(K.spawned(session), "s7")  # still waiting, still registered

    await redis.set(K.lease(other), "n|w2", px=10_000)
    doc2 = json.dumps({"id": "t1", "session": other, "state": "queued", "after": "1-0"})
    added = await store.add(other, "n|w2", other, "t1", doc2, **caps | {"scope": "web/v"})
    assert added == -2, (
        "a second session of the channel got a subagent past AGENT_SUBAGENT_SESSIONS_PER_"
        "CHANNEL=1 while a result put off for a private session still holds its slot "
        f"(index now: {await redis.zrange(K.subagents('web'), 0, -1)})"
    )


async def test_a_dead_workers_result_put_off_past_an_hour_is_delivered(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, monkeypatch
) -> None:
    """The same aged index entry, pruned by another session's spawn: then the worker that
    put the result off dies (its in-process deferred job with it). A survivor looks for
    what it left through the channel index only (``Orphans.rerun``): the result, still
    registered, is never delivered after the private session ends."""
    monkeypatch.setattr(results_mod, "PUT_OFF_S", 0.05)
    monkeypatch.setattr(results_mod, "PUT_OFF_MAX_S", 0.05)
    session, other, sid = "web:sc", "web:sd2", "s6"
    store = await _waiting_on_a_private_session(redis, session, sid, "r6", worker="dead")
    await _aged_an_hour(redis, session)
    assert await store.finish(session, sid, _result(session, sid), run="r6") == -3
    assert await store.put_off(session, sid, _result(session, sid), "r6") == 1
    await redis.set(K.lease(other), "n|w2", px=10_000)  # another chat of the channel spawns
    doc2 = json.dumps({"id": "t2", "session": other, "state": "queued", "after": "1-0"})
    assert await store.add(other, "n|w2", other, "t2", doc2, **CAPS | {"scope": "web/v"}) == 1
    await redis.delete(K.owner(session))  # the private session ended; ``dead`` is dead
    before = await redis.xlen(K.inbound(session))

    survivor = AgentLoop(RedisBus(redis), ScriptedProvider([]))
    try:
        await survivor.subagents.rerun_orphans("dead", {"web"})
        await _delivered(
            redis,
            session,
            before,
            "a dead worker's put-off result was not delivered: its session had left the channel index",
        )
    finally:
        await survivor.jobs.aclose()
