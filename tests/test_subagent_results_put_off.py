"""A subagent's result that meets a private session on its stored session's key is put
off, not lost: before, it was published behind the private session's opening, refused
there (it was made by the stored conversation: ``session_not_active``) and lost, its work
paid for nothing. Now it waits in its registration and a job of its own delivers it into
the stored chat once the private session has ended (its history, none of the private
one's). Each test failed on the code before the change."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import redis.asyncio as aioredis
from helpers import ScriptedProvider, Spawner, held_jobs
from replies import channel_events, collect, open_private, until
from test_private_beside_durable import _durable, _private

from bus_redis import FrontendClient, Keys, RedisBus
from bus_redis.subagents import SubagentStore
from worker import AgentLoop
from worker.jobs.subagents import JOB_NAME as SUBAGENT_JOB

K = Keys()


class Recording(Spawner):
    """A spawner that keeps every model call's messages."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    async def __call__(self, **kw: Any) -> Any:
        self.calls.append(json.dumps(kw["messages"]))
        return await super().__call__(**kw)


async def test_a_result_waits_out_the_private_session_on_its_key(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """The stored chat ``web:sp`` spawns a subagent; the user opens a private session on
    ``web:sp`` before it finishes. Its result is neither answered in the private
    conversation nor lost: once the private session ended, it is answered in the stored
    chat, whose history it sees; the subagent ran once."""
    model = Recording()
    loop = make_loop(ScriptedProvider(handler=model), followup_mode="queue")
    queued = held_jobs(loop, SUBAGENT_JOB)
    client = FrontendClient(redis)
    assert (await client.ask(_durable("sp", "research TEA-DURABLE", "q"), timeout_s=10)).type == (
        "message"
    )
    [job] = queued
    key = await open_private(client, "sp")
    private = _private(key, "PRIVATE-SECRET-6", "p1")
    assert (await client.ask(private, timeout_s=10)).type == "message"

    await loop.subagents.run_job(
        session=job["session"], sid=job["sid"]
    )  # it finishes while the private session is open
    assert model.subagent_runs == 1
    answered = [
        e for e in await channel_events(client, "web") if e.reply_to == f"spawn:{job['sid']}"
    ]
    assert answered == [], f"the result was answered in the private session: {answered}"
    assert await redis.hexists(K.spawned("web:sp"), job["sid"]), "the result was lost"
    [again] = queued[1:]  # its delivery, queued for later
    assert again["defer_until_ms"] is not None
    assert again["job_id"] != job["job_id"]

    # the private session ends (idle: a discard of the key is an aborting control of the
    # stored session's subagents too, README)
    await loop.maintenance.close_private(key, "the private session was closed after being idle")
    await until(lambda: _gone(redis, K.owner(key)), timeout_s=10)
    await loop.subagents.run_job(session=again["session"], sid=again["sid"])
    rid = f"spawn:{job['sid']}"
    [reply] = [e for e in (await collect(client, "web", {rid}, timeout_s=10))[rid] if e.is_terminal]
    assert (reply.type, reply.code) == ("message", None)
    assert model.subagent_runs == 1, "the subagent ran again"
    [ran] = [c for c in model.calls if "found: 42" in c]
    assert "TEA-DURABLE" in ran, "the result ran without the stored chat's history"
    assert "PRIVATE-SECRET-6" not in ran, "the result ran in the private conversation"
    assert not await redis.exists(K.spawned("web:sp"))  # unregistered once delivered


async def test_a_result_waits_for_an_opening_not_handled_yet(redis: aioredis.Redis) -> None:
    """The opening of a private session on ``web:sw`` is published and no worker has
    handled it yet (no owner record until then): a result published now would follow it
    into the private conversation. It is put off too; a stop of the stored chat after
    the spawn still unregisters it, and nothing is published then."""
    store = SubagentStore(RedisBus(redis))
    await redis.set(K.lease("web:sw"), "n|w", px=10_000)
    doc = json.dumps({"id": "s1", "state": "running", "run": "r1", "after": "1-0"})
    caps = {"limit": 2, "channel_limit": 8, "scope": "web/u", "scope_limit": 2}
    assert await store.add("web:sw", "n|w", "web:sw", "s1", doc, **caps) == 1
    client = FrontendClient(redis)
    await client.open_transient("web", "sw", session_key="web:sw")  # nobody handles it
    before = await redis.xlen(K.inbound("web:sw"))
    assert await store.finish("web:sw", "s1", '{"content": "result"}', run="r1") == -3
    assert await redis.xlen(K.inbound("web:sw")) == before, "published behind the opening"
    assert await store.put_off("web:sw", "s1", '{"content": "result"}', "r1") == 1
    assert await store.put_off("web:sw", "s1", '{"content": "result"}', "other") == 0
    assert await store.drop("web:sw", "s1")  # a stop's unregistration
    assert await store.finish("web:sw", "s1", '{"content": "result"}', run="r1") == 0
    assert await redis.xlen(K.inbound("web:sw")) == before


async def test_a_put_off_result_left_by_a_dead_worker_is_delivered_again(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis,
) -> None:
    """A worker put a result off and died (an in-process queue's deferred job died with
    it): a survivor that judges it dead queues its delivery again."""
    store = SubagentStore(RedisBus(redis))
    await redis.set(K.lease("web:sd"), "n|w", px=10_000)
    doc = json.dumps({"id": "s2", "state": "running", "worker": "dead", "run": "r2"})
    caps = {"limit": 2, "channel_limit": 8, "scope": "web/u", "scope_limit": 2}
    assert await store.add("web:sd", "n|w", "web:sd", "s2", doc, **caps) == 1
    assert await store.put_off("web:sd", "s2", '{"content": "result"}', "r2") == 1
    survivor = AgentLoop(RedisBus(redis), ScriptedProvider([]))
    queued = held_jobs(survivor, SUBAGENT_JOB)
    try:
        assert await survivor.subagents.rerun_orphans("dead", {"web"}) == 1
    finally:
        await survivor.jobs.aclose()
    assert [(q["session"], q["sid"]) for q in queued] == [("web:sd", "s2")]


async def _gone(redis: aioredis.Redis, key: str) -> bool:
    return not await redis.exists(key)


async def test_two_deliveries_put_off_at_once_still_leave_one_next_try(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis,
) -> None:
    """A delivery running under the base id (a survivor queues a dead worker's there) and
    one under ``:again`` both meet the private session at the same moment: each finds both
    ids taken (by the other and by itself). Before, neither queued a next try and the
    result waited in its registration forever, its slot taken."""
    store = SubagentStore(RedisBus(redis))
    await redis.set(K.lease("web:s2"), "n|w", px=10_000)
    doc = json.dumps({"id": "s3", "state": "running", "run": "r3"})
    caps = {"limit": 2, "channel_limit": 8, "scope": "web/u", "scope_limit": 2}
    assert await store.add("web:s2", "n|w", "web:s2", "s3", doc, **caps) == 1
    await FrontendClient(redis).open_transient("web", "s2", session_key="web:s2")
    loop = AgentLoop(RedisBus(redis), ScriptedProvider([]))
    base = loop.subagents._job_id("s3")
    running = {base, base + ":again"}  # both deliveries run now
    queued: list[str] = []

    async def enqueue(name: str, *, job_id: str, **kw: Any) -> bool:
        if job_id in running or job_id in queued:
            return False
        queued.append(job_id)
        return True

    loop.jobs.enqueue = enqueue  # type: ignore[method-assign]
    try:
        results = loop.subagents.results
        await asyncio.gather(
            results.publish("web:s2", "s3", '{"content": "r"}', run="r3"),
            results.publish("web:s2", "s3", '{"content": "r"}', run="r3"),
        )
    finally:
        await loop.jobs.aclose()
    assert queued, "neither delivery queued a next try"
    assert not set(queued) & running
    assert await redis.hexists(K.spawned("web:s2"), "s3")
