"""A worker killed (kill -9) around a schedule's firing, with real processes: just before
``cron_fire.lua`` (the firing's job dies with it) and just after it (the firing is in the
session's stream, the next one not queued yet). The survivor delivers every firing once:
the one cut off before its publish late (its sweep finds it overdue), the one published
by the dead worker from the stream; the schedule goes on firing, and no firing is answered
twice (README: a firing is delivered once, whichever and however many workers run)."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from replies import channel_events, until
from workers import crash_env

from bus_redis import FrontendClient, InboundMessage, Keys

pytestmark = [pytest.mark.real_redis, pytest.mark.slow]
ENV = {
    "AGENT_LOCK_TTL_MS": "1000",
    "AGENT_SWEEP_INTERVAL_MS": "300",
    "AGENT_CRON_MIN_EVERY_S": "1",
}


@pytest.mark.parametrize("when", ["before", "after"])
async def test_a_firing_cut_by_a_crash_is_delivered_once_and_the_schedule_goes_on(
    real_redis, spawn_workers, tmp_path, when: str
) -> None:  # type: ignore[no-untyped-def]
    crash = crash_env(tmp_path, "worker.jobs.schedules:Schedules.fire", when)
    [doomed] = spawn_workers(1, env={**ENV, **crash})
    client = FrontendClient(real_redis)
    add = json.dumps({"action": "add", "every_seconds": 2, "message": "tick"})
    await client.ask(
        InboundMessage(
            id="m1", channel="web", chat_id="t", sender_id="u", content=f"toolcall:cron{add}"
        ),
        timeout_s=30,
    )
    [sid] = await real_redis.smembers(Keys().crons("web:t"))
    first = int(await real_redis.zscore(Keys().cron_due("web"), sid))  # (2 s ahead)
    assert await _exit(doomed) == 137  # at its first firing
    spawn_workers(1, env=ENV)

    async def firings() -> Counter[str]:
        return Counter(
            ev.reply_to or ""
            for ev in await channel_events(client, "web")
            if ev.is_terminal and (ev.reply_to or "").startswith("cron:")
        )

    async def three_answered() -> bool:
        return len(await firings()) >= 3

    await until(three_answered, timeout_s=40)
    answered = await firings()
    assert set(answered.values()) == {1}, answered  # each firing answered once
    assert f"cron:{sid}:{first}" in answered  # the one the crash cut too
    h = await real_redis.hgetall(Keys().session("web:t"))
    rows = [json.loads(h[f"m:{i}"]) for i in range(int(h["count"]))]
    fired = [r.get("message_id") for r in rows if r["role"] == "user" and r.get("message_id")]
    fired = [mid for mid in fired if mid.startswith("cron:")]
    assert len(fired) == len(set(fired)), fired  # each stored once


async def _exit(proc) -> int:  # type: ignore[no-untyped-def]
    import asyncio

    return await asyncio.to_thread(proc.proc.wait, 30)
