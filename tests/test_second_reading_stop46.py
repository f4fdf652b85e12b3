"""A hostile second reading of f5ce182 (firings put off, the unified session's schedules,
consolidation limits, a private session's end, the gateway's attempts). Each test names
the defect it shows and the behaviour that is right; each failed on f5ce182."""

from __future__ import annotations

import time

import pytest
import redis.asyncio as aioredis
from helpers import ScriptedProvider
from replies import until, wait_until_async
from test_consolidation import _last_consolidated
from test_firings_put_off import stored_every
from test_flood_fairness import LOW, Model, _long_sessions

from bus_redis import Keys, RedisBus
from worker import AgentLoop

K = Keys()
UNIFIED = "unified:default"


# (its first finding, a unified chat's one-shot firing delivered into the private
# session on the chat's key, is the `unified` case of the one-shot test in
# test_firings_put_off.py)


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
    await stored_every(redis, "web:cad", "cad", due, anchored=True)
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
