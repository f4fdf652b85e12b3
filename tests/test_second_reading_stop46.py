"""A hostile second reading of f5ce182 (firings put off, the unified session's schedules,
consolidation limits, a private session's end, the gateway's attempts). Each test names
the defect it shows and the behaviour that is right; each failed on f5ce182."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis.asyncio as aioredis
from helpers import ScriptedProvider
from replies import collect, until, wait_until_async
from test_consolidation import _last_consolidated
from test_flood_fairness import LOW, Model, _long_sessions
from test_private_beside_durable import _durable, _private

from bus_redis import FrontendClient, Keys, RedisBus
from worker import AgentLoop
from worker.agent.providers import LLMResponse, ToolCallRequest
from worker.jobs.schedules import Schedule

K = Keys()
UNIFIED = "unified:default"


async def test_unified_a_one_shot_firing_waits_out_the_private_session_on_its_chats_key(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """Defect (``bus_redis/schedules.py`` ``fire``: KEYS[12] is ``owner(key)``, the
    *effective* key): in unified mode a chat's schedule has ``key = unified:default``,
    but a private session opened on the chat's own key ``web:os`` has its owner record
    under ``web:os``. ``cron_fire.lua`` looks at ``owner(unified:default)``, never there,
    so the firing is delivered into ``web:os``'s stream while the private session is open
    there, answered ``session_not_active`` (it must not run in the private conversation)
    and the one-shot is gone: the very loss 89e37e3 fixed, left in unified mode. Right
    (ARCHITECTURE "A private session opened on a key that holds a stored one", README:
    "A schedule of the stored session that comes due while a private session is open on
    its key is put off"): the firing is put off while the private session is open on the
    stream it is delivered to, and fires once (in the stored conversation) after it ended."""
    calls: list[str] = []
    at = (datetime.now(UTC) + timedelta(hours=1)).isoformat(timespec="seconds")

    async def model(**kw: Any) -> LLMResponse:
        calls.append(json.dumps(kw["messages"]))
        last = kw["messages"][-1]
        if last["role"] == "user" and last["content"] == "remind me about TEA-DURABLE":
            args = {"action": "add", "at": at, "message": "ONE-SHOT-NOW"}
            return LLMResponse(tool_calls=[ToolCallRequest("c1", "cron", args)])
        return LLMResponse(content="ok")

    loop = make_loop(ScriptedProvider(handler=model), followup_mode="queue", unified_session=True)
    client = FrontendClient(redis)
    ask = _durable("os", "remind me about TEA-DURABLE", "r1", scope="u")
    assert (await client.ask(ask, timeout_s=10)).type == "message"
    [sid] = list(await redis.smembers(K.crons("web:os")))
    assert await redis.exists(K.session(UNIFIED))
    key, opened = await client.open_transient("web", "os", session_key="web:os", scope="u")
    await collect(client, "web", {opened}, timeout_s=10)
    private = _private(key, "PRIVATE-SECRET-5", "p1", scope="u")
    assert (await client.ask(private, timeout_s=10)).type == "message"
    assert await redis.exists(K.owner(key))

    due = int(time.time() * 1000) - 1000  # its time came
    assert await redis.zadd(K.cron_due("web"), {sid: due}, xx=True, ch=True) == 1
    delivered = await loop.schedules.fire(channel="web", sid=sid, due_ms=due)
    firing = f"cron:{sid}:{due}"
    if delivered:  # (what f5ce182 does: see how it is answered)
        events = (await collect(client, "web", {firing}, timeout_s=10))[firing]
        answer = [e for e in events if e.is_terminal][-1]
        assert (answer.type, answer.code) == ("message", None), (
            f"the one-shot fired into the private session's stream and was answered "
            f"{answer.code}: the reminder is lost"
        )
    assert not delivered, "a firing was delivered into the private session's stream"
    assert await redis.hget(K.cron_defs("web"), sid) is not None, "the one-shot was lost"


async def _every_schedule(redis: aioredis.Redis, session: str, sid: str, due: int) -> None:
    """An hourly ``every`` schedule of stored session ``session`` due at ``due``."""
    store = AgentLoop(RedisBus(redis), ScriptedProvider([])).schedules.store
    doc = Schedule(
        id=sid, session=session, channel="web", chat_id=session.split(":", 1)[1],
        message="tick", kind="every", every_s=3600, created_ms=0,
        anchor_ms=due,  # (as the cron tool's add sets it since the fix)
    ).model_dump_json()  # fmt: skip
    await redis.set(K.lease(session), "n|w", px=10_000)
    caps = {"limit": 3, "channel_limit": 99, "scope": f"web/{sid}", "scope_limit": 9}
    assert await store.add(session, "n|w", session, sid, doc, due, **caps) == 1
    await redis.delete(K.lease(session))
    await redis.hset(K.session(session), "count", 0)  # its turn was committed


async def test_a_put_off_every_firing_keeps_the_schedules_cadence(redis, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Defect (``cron_fire.lua`` ``later()`` re-scores the firing itself to now+10 s, and
    ``Schedules.fire`` then computes ``next_due`` from that score): an ``every 3600 s``
    schedule due at T whose firing is put off (a private session open on its key) fires
    at T+10 s, and its next firing is T+10 s+1 h, every one after that too: each put-off
    shifts the schedule's phase for good (a private session open for 25 minutes moves an
    hourly reminder from :00 to :25 for ever). Missed firings keep the phase (README:
    "then at its first time after now"; ``next_due`` steps from the due time). Right:
    the put-off firing is delivered late, once, and the schedule's next firing is still
    T + 1 h (its own times), not 1 h after whenever the put-off firing happened to land."""
    import worker.jobs.schedules as schedules_module

    monkeypatch.setattr(schedules_module, "PUT_OFF_MS", 1)  # (put off 1 ms, not 10 s)
    loop = AgentLoop(RedisBus(redis), ScriptedProvider([]))
    due = int(time.time() * 1000) - 1_000
    await _every_schedule(redis, "web:cad", "cad", due)
    await redis.hset(K.owner("web:cad"), "worker", "elsewhere")  # a private session is open
    await redis.pexpire(K.owner("web:cad"), 60_000)
    assert not await loop.schedules.fire(channel="web", sid="cad", due_ms=due)
    later = int(await redis.zscore(K.cron_due("web"), "cad"))
    assert later > due  # put off

    await redis.delete(K.owner("web:cad"))  # the private session ended

    async def delivered() -> bool:  # (its job, or else the sweep, fires it once due)
        if int(time.time() * 1000) > later:
            await loop.schedules.sweep({"web"})
        return bool(await redis.exists(K.inbound("web:cad")))

    await until(delivered, timeout_s=10)
    assert await redis.xlen(K.inbound("web:cad")) == 1  # delivered once, late
    nxt = int(await redis.zscore(K.cron_due("web"), "cad"))
    assert nxt == due + 3_600_000, (
        f"one put-off moved the hourly schedule's times by {nxt - due - 3_600_000} ms"
    )
    await loop.jobs.aclose()


async def test_a_consolidation_left_for_its_channels_bound_is_done_without_another_commit(
    redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defect (``worker/jobs/consolidation.py`` ``run_job``: a job over
    ``consolidations_per_channel`` returns at once, "left to the session's next
    commit"): five long sessions of one channel; four consolidations run (their model
    calls slow), the fifth session's job is left. Its chat then goes quiet: no next
    commit ever comes, so its over-budget rows are never folded into memory (and the
    idle prune later deletes them unfolded). Before f5ce182 the job waited for a slot and
    ran. Right: a job left for the channel's bound runs once the channel's running ones
    are done (it waits, or is queued again), without the session needing another turn."""
    import worker.jobs.consolidation as consolidation_module

    monkeypatch.setattr(consolidation_module, "AGAIN_AFTER_S", 0.05)  # (not 30 s)
    model = Model()
    loop = AgentLoop(RedisBus(redis), ScriptedProvider(handler=model), config=LOW)
    limit = LOW.consolidations_per_channel
    try:
        await _long_sessions(loop, "web", limit + 1)  # sessions web:long0 .. web:long<limit>

        async def bound_reached() -> bool:
            return model.folding >= limit

        assert await wait_until_async(bound_reached, timeout_s=10)
        last = f"web:long{limit}"
        assert await _last_consolidated(redis, last) == 0  # left: its channel's were running
        model.release.set()  # the running ones end; the chat of `last` says nothing more

        async def folded() -> bool:
            return await _last_consolidated(redis, last) > 0

        assert await wait_until_async(folded, timeout_s=15), (
            f"{last}'s consolidation, left for the channel's bound, never ran "
            f"({model.folds} folds in all)"
        )
    finally:
        model.release.set()
        await loop.jobs.aclose()
