"""Known, not fixed (docs/ARCHITECTURE.md, "Known, not fixed" and "Left:"): private
sessions beside a stored one, ``new`` after their end, owner records and loss reports,
and schedules' firings around private sessions and uncommitted turns. Each test fails on
ebacb12 for the reason its docstring gives and states what is expected instead. (A
firing published between a private opening's publish and its handling is still answered
``session_not_active``: ARCHITECTURE, "Left:"; its test is not here.)

No test sleeps to synchronise: each waits on a condition with a bound. The worker's
maintenance (which reports lost owners) ticks at its start and then every
``lock_ttl_ms / 3``; tests that need no loss report in their window take a long lease
TTL, so that its next tick falls after the test."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import fakeredis.commands_mixins.server_mixin as fake_server_mixin
import fakeredis.model._stream as fake_stream
import pytest
import redis.asyncio as aioredis
from helpers import ScriptedProvider
from replies import collect, open_private, until, wait_until_async
from test_private_beside_durable import _durable, _durable_then_private, _private, _summarising

import worker.jobs.schedules as schedules_module
from bus_redis import FrontendClient, Keys
from bus_redis.codec import stream_id_ms
from worker.agent.providers import LLMResponse, ToolCallRequest
from worker.jobs.schedule_rules import iso

K = Keys()
QUIET = {"lock_ttl_ms": 60_000, "owner_ttl_ms": 60_000}  # no owners' sweep mid-test


def _folded(provider: ScriptedProvider) -> bool:
    """Whether the model was asked for a summary (a ``new`` folding a stored session)."""
    return any(str(c["messages"][0]["content"]).startswith("Summarise") for c in provider.calls)


def _no_end_written(end: str | None) -> bool:
    """No drop or loss report wrote where the private session ended: at most the
    provisional end its opening and renewals wrote (``<ms>|<member>``)."""
    return end is None or "|" in end


async def _marker_consumed(redis: aioredis.Redis, key: str) -> None:
    async def consumed() -> bool:
        return not await redis.xlen(K.inbound(key))

    await until(consumed, timeout_s=10)


# --- 1. a private session whose worker vanished: no end written until the loss report ---


async def test_a_new_of_a_private_session_whose_worker_vanished_keeps_the_stored_session(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """Defect (ARCHITECTURE, "Known, not fixed"): a private session is open on ``web:kv``
    beside a stored conversation there. Its worker is killed (-9): nothing drops its
    owner record, which runs out; ``P:{C}:ended:<S>`` is written only by ``owner.lua``
    drop and ``owner_lost.lua``, i.e. when a survivor's owners' sweep
    (``Maintenance._lost_owners``, one tick after the record expired) reports the loss.
    The user's ``/new`` in the private chat (the frontend was told nothing yet) reached
    in between, by any worker, finds no owner, no ``ended:<S>`` and no memory of the
    session (``SessionHolder.discarded``: ``owned`` None, ``take_ended`` False,
    ``private_ended_ms`` None) and runs as a durable ``new``: the stored conversation on
    the key is summarised into memory and deleted.
    Expected: a ``new`` published while the private session was open (before its loss
    was reported) is a discard of the private session; the stored session stays and is
    not folded.
    Simulated as ``test_private_new_unified`` does: the worker forgets the session and
    the record is gone (ran out), while the owners' registry still names it (no loss
    reported yet)."""
    provider = _summarising()
    loop = make_loop(provider, **QUIET)
    client = FrontendClient(redis)
    key = await _durable_then_private(client, "kv")
    member = loop.turns.owned()[key]
    # what a kill -9 of the owner leaves once its record ran out, before any report
    loop.rt.forget(key)
    await redis.delete(K.owner(key))
    assert await redis.zscore(K.owners("web"), member) is not None  # loss not reported
    assert _no_end_written(await redis.get(K.private_end(key)))
    await client.new(key)  # the user's /new in the private chat
    await _marker_consumed(redis, key)
    assert not _folded(provider), "the private chat's new summarised the stored session"
    assert await redis.hexists(K.session(key), "meta"), (
        "a new meant for the private session (its worker gone, its loss not reported yet) "
        "deleted the stored session beside it"
    )


async def test_a_new_after_a_kill_9_of_the_private_sessions_worker_keeps_the_stored_session(  # type: ignore[no-untyped-def]
    real_redis: aioredis.Redis, spawn_workers
) -> None:
    """The same defect with real processes and a real kill -9. w0 (lease and owner TTL
    1 s) holds the stored conversation and the private session on ``web:k9``; w1, the
    survivor, has a 30 s lease TTL, so its maintenance ticks at its start and then every
    10 s: the test waits for a tick of w1 (its heartbeat), kills w0, waits until w0's
    owner record ran out and publishes the user's ``/new`` of the private chat, all
    within w1's next 10 s, before its owners' sweep reports the loss. w1 reaches the
    marker, finds no owner and no ``ended:<S>`` and folds and deletes the stored
    session. Expected: the stored session stays (the ``new`` was the private session's)."""
    client = FrontendClient(real_redis)
    [w0] = spawn_workers(1, env={"AGENT_LOCK_TTL_MS": "1000", "AGENT_OWNER_TTL_MS": "1000"})
    key = "web:k9"
    for i in range(2):
        reply = await client.ask(_durable("k9", f"durable turn {i}", f"d{i}"), timeout_s=15)
        assert reply.type == "message"
    assert await open_private(client, "k9") == key
    reply = await client.ask(_private(key, "a private word", "p1"), timeout_s=10)
    assert (reply.type, reply.code) == ("message", None)
    assert await real_redis.hget(K.owner(key), "worker") == "w0"
    spawn_workers(1, env={"AGENT_LOCK_TTL_MS": "30000", "AGENT_OWNER_TTL_MS": "30000"})

    async def w1_ticked() -> bool:  # its first maintenance tick beat (not its start's claim)
        return await real_redis.hexists(K.worker_info("w1"), "dead_after_ms")

    assert await wait_until_async(w1_ticked, timeout_s=15)
    first_tick = await real_redis.zscore(K.workers, "w1")
    w0.kill()  # type: ignore[attr-defined]

    async def record_ran_out() -> bool:
        return not await real_redis.exists(K.owner(key))

    assert await wait_until_async(record_ran_out, timeout_s=5)
    # no loss reported yet (at most the end its renewals foresaw)
    assert _no_end_written(await real_redis.get(K.private_end(key)))
    await client.new(key)  # the user's /new in the private chat

    async def consumed() -> bool:
        return not await real_redis.xlen(K.inbound(key))

    assert await wait_until_async(consumed, timeout_s=8)
    assert await real_redis.zscore(K.workers, "w1") == first_tick, "w1 ticked in between"
    assert await real_redis.hexists(K.session(key), "meta"), (
        "after a kill -9 of the private session's worker, its /new folded and deleted the "
        "stored session beside it"
    )


# --- 2. the end is kept in milliseconds: a `new` of that very millisecond ---------------


class _Clock:
    """fakeredis' clock for ``TIME`` (scripts included) and ``XADD *``: real, or frozen."""

    def __init__(self) -> None:
        self.frozen: float | None = None

    def time(self) -> float:
        return time.time() if self.frozen is None else self.frozen

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


@pytest.mark.parametrize("redis_factory", ["fake"], indirect=True)
async def test_a_new_published_in_the_millisecond_the_private_session_ended_folds_the_stored_one(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defect (ARCHITECTURE, "Known, not fixed": "the end is kept in milliseconds"):
    ``owner.lua`` (drop) and ``owner_lost.lua`` write ``ended:<S>`` as Redis ms, and
    ``SessionHolder.discarded`` takes a ``new`` whose marker id's ms is ``<=`` it for the
    private session's (``stream_id_ms(marker) <= ended``). The private session on
    ``web:tie`` is discarded, and then, in the same millisecond, the user's ``/new`` of
    the (now durable) chat is published: its marker is ``<ended ms>-<seq>``, after the
    end in the stream, yet it is taken for the private session's and discarded; the
    stored conversation is neither summarised nor cleared.
    Expected: a ``new`` published after the end (a later stream id, whatever its ms) is
    the stored session's ``new``: it folds and clears it (README: "After a private
    session ends ... a message of its key ... is durable"). Deterministic on fakeredis,
    whose clock (``TIME`` and ``XADD *`` ids) the test freezes for that millisecond."""
    clock = _Clock()
    monkeypatch.setattr(fake_stream, "time", clock)
    monkeypatch.setattr(fake_server_mixin, "time", clock)
    provider = _summarising()
    make_loop(provider, **QUIET)
    client = FrontendClient(redis)
    key = await _durable_then_private(client, "tie")
    clock.frozen = time.time()  # one millisecond from here on
    try:
        await client.discard(key)  # the private session ends

        async def ended() -> bool:  # (not the provisional end of its opening)
            return not _no_end_written(await redis.get(K.private_end(key)))

        await until(ended, timeout_s=10)
        await client.new(key)  # then the user starts afresh in the durable chat
        [(marker, _)] = (await redis.xrange(K.inbound(key)))[-1:]
        assert stream_id_ms(marker) == int(clock.frozen * 1000)  # after the end, same ms
        await _marker_consumed(redis, key)
    finally:
        clock.frozen = None
    assert _folded(provider), (
        "a new published after the private session ended (in the same millisecond) was "
        "taken for the private session's: the stored conversation was not summarised"
    )
    assert not await redis.hexists(K.session(key), "meta"), "nor cleared"


# --- 4. a schedule added by a turn that was never committed ------------------------------


@pytest.mark.parametrize("unified", [True, False])
async def test_a_schedule_added_by_a_turn_never_committed_does_not_fire(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop, unified: bool
) -> None:
    """Defect (ARCHITECTURE, Schedules: "So in unified mode a schedule added by a turn
    that was never committed (its commit failed for good) fires all the same"). A turn
    adds a one-shot schedule (``cron_add.lua``, fenced, written at once), then fails
    (an error that is no provider error): the entry is tried again up to
    ``AGENT_MAX_DELIVERIES`` (here 1) and dead-lettered; nothing of the turn is stored
    and the user got ``dead_lettered``, but no undo runs for a failed turn (only
    ``execution._undo`` for cut turns), so the schedule stays. ``cron_fire.lua`` drops
    it only when the session hash is missing and never in unified mode (``ARGV[8]``
    '1'): in unified mode, and (the same gap, a related case) in per-session mode when
    the chat has an earlier stored turn, the reminder the user never saw confirmed
    fires and runs a turn.
    Expected: a schedule of a turn that was never committed does not fire (removed with
    the dead letter, or dropped at its firing)."""
    at = (datetime.now(UTC) + timedelta(hours=1)).isoformat(timespec="seconds")
    fired_into: list[str] = []

    async def model(**kw: Any) -> LLMResponse:
        messages = kw["messages"]
        last = messages[-1]
        if "NEVER-CONFIRMED" in json.dumps(messages[-1:]) and last["role"] == "user":
            fired_into.append(last["content"])
        if last["role"] == "user" and last["content"] == "remind me":
            args = {"action": "add", "at": at, "message": "NEVER-CONFIRMED"}
            return LLMResponse(tool_calls=[ToolCallRequest("c1", "cron", args)])
        if last["role"] == "tool":
            raise RuntimeError("the turn fails after its tool call")
        return LLMResponse(content="ok")

    loop = make_loop(
        ScriptedProvider(handler=model), unified_session=unified, max_deliveries=1,
        followup_mode="queue",
    )  # fmt: skip
    client = FrontendClient(redis)
    assert (await client.ask(_durable("nc", "hello", "m0"), timeout_s=10)).type == "message"
    reply = await client.ask(_durable("nc", "remind me", "m1"), timeout_s=15)
    assert reply.code == "dead_lettered"
    sids = list(await redis.smembers(K.crons("web:nc")))
    if not sids:
        return  # removed with the dead letter: as expected
    [sid] = sids
    due = int(time.time() * 1000) - 1000
    assert await redis.zadd(K.cron_due("web"), {sid: due}, xx=True, ch=True) == 1
    fired = await loop.schedules.fire(channel="web", sid=sid, due_ms=due)
    if fired:
        firing = f"cron:{sid}:{due}"
        await collect(client, "web", {firing}, timeout_s=10)
    assert not fired, (
        f"a schedule added by a turn that was dead-lettered (never committed) fired "
        f"(unified={unified}); the model ran it: {bool(fired_into)}"
    )


async def test_a_schedule_of_a_lost_attempt_goes_when_a_stop_cancels_its_rerun(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """A turn adds a schedule and then fails; before its entry runs again, the user's
    stop covers it: the entry is answered ``cancelled`` without running again, none of
    its rows is kept, and so the schedule its lost attempt added (the journal names the
    call) goes with it, as a discard of the running turn would take it (it stayed)."""
    at = (datetime.now(UTC) + timedelta(hours=1)).isoformat(timespec="seconds")
    client = FrontendClient(redis)
    key = "web:sc"

    async def model(**kw: Any) -> LLMResponse:
        last = kw["messages"][-1]
        if last["role"] == "user" and last["content"] == "remind me":
            args = {"action": "add", "at": at, "message": "STOPPED"}
            return LLMResponse(tool_calls=[ToolCallRequest("c1", "cron", args)])
        if last["role"] == "tool":
            assert await client.stop(key) >= 1  # the user stops it before its re-run
            raise RuntimeError("the attempt fails after its tool call")
        return LLMResponse(content="ok")

    make_loop(ScriptedProvider(handler=model), max_deliveries=3, followup_mode="queue")
    assert (await client.ask(_durable("sc", "hello", "m0"), timeout_s=10)).type == "message"
    reply = await client.ask(_durable("sc", "remind me", "m1"), timeout_s=15)
    assert reply.code == "cancelled"
    assert not await redis.smembers(K.crons(key)), "the lost attempt's schedule stayed"


# --- 5. a put-off firing's message names when it fired, not when it was due ------------


async def test_a_put_off_firing_names_the_time_it_was_due(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defect (ARCHITECTURE, Schedules: a firing put off "fires late, once, its message
    naming the time it fired at"). ``cron_fire.lua`` moves a firing that cannot be
    delivered (a private session open on the chat's key) to ``retry_ms`` in the due index
    and forgets when it was due; ``Schedules.fire`` is then called with that score as
    ``due_ms`` and ``Schedules._message`` writes it as the firing's time: the model and
    the user read "due <put-off time>" and ``metadata.cron.due_ms`` is the put-off time,
    for a one-shot reminder set for another time (a private session open for an hour
    makes a 9:00 reminder say 10:00).
    Expected: the message (and ``metadata.cron.due_ms``) names the time it was due; a
    late firing may say it is late, but not move its due time."""
    at_dt = datetime.now(UTC) + timedelta(hours=1)
    calls: list[list[dict[str, Any]]] = []

    async def model(**kw: Any) -> LLMResponse:
        calls.append(kw["messages"])
        last = kw["messages"][-1]
        if last["role"] == "user" and last["content"] == "remind me":
            args = {"action": "add", "at": at_dt.isoformat(timespec="seconds"), "message": "TEA"}
            return LLMResponse(tool_calls=[ToolCallRequest("c1", "cron", args)])
        return LLMResponse(content="ok")

    loop = make_loop(ScriptedProvider(handler=model), followup_mode="queue")
    client = FrontendClient(redis)
    assert (
        await client.ask(_durable("po", "remind me", "r1", scope="u"), timeout_s=10)
    ).type == "message"
    [sid] = list(await redis.smembers(K.crons("web:po")))
    due = int(await redis.zscore(K.cron_due("web"), sid))  # when the user asked for it
    key, opened = await client.open_transient("web", "po", session_key="web:po", scope="u")
    await collect(client, "web", {opened}, timeout_s=10)
    monkeypatch.setattr(schedules_module, "now_ms", lambda: due + 5)  # its time came
    assert not await loop.schedules.fire(channel="web", sid=sid, due_ms=due)  # put off
    retry = int(await redis.zscore(K.cron_due("web"), sid))
    assert retry > due
    assert await client.discard(key) >= 1  # the private session ends

    async def ended() -> bool:
        return not await redis.exists(K.owner(key))

    await until(ended, timeout_s=10)
    monkeypatch.setattr(schedules_module, "now_ms", lambda: retry + 5)  # the sweep, later
    assert await loop.schedules.fire(channel="web", sid=sid, due_ms=retry)
    firing = f"cron:{sid}:{retry}"
    await collect(client, "web", {firing}, timeout_s=10)
    [text] = [m["content"] for c in calls for m in c[-1:] if "TEA" in str(m["content"])]
    assert f"due {iso(due, 'UTC')}" in text, (
        f"the put-off firing names the time it fired, not its due time {iso(due, 'UTC')}: {text!r}"
    )


# --- related: a discarded re-run of a turn leaves the schedule its first attempt added ---


async def test_a_discarded_rerun_takes_the_schedule_its_first_attempt_added_with_it(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """Related defect (README, Tools: "a turn that is discarded takes the schedules it
    added with it"; ARCHITECTURE admits "not after a crash: a re-run replays the
    journaled call without running the tool, so a discard of that re-run leaves the
    schedule"). A turn adds a one-shot schedule and its attempt fails after the call
    (as a worker killed after the tool ran does: the entry is run again); the re-run
    replays the journaled ``cron`` call (no tool run, so no ``ctx.undo`` entry), and the
    user discards it while it runs: the turn is cancelled and nothing of it is stored,
    but ``execution._undo`` has nothing to undo and the schedule stays and fires later.
    Expected: a discarded turn takes its schedules with it, also those of a replayed
    (journaled) call: the re-run registers the undo of a replayed ``cron`` add."""
    at = (datetime.now(UTC) + timedelta(hours=1)).isoformat(timespec="seconds")
    rerun, never = asyncio.Event(), asyncio.Event()
    after_tool = 0

    async def model(**kw: Any) -> LLMResponse:
        nonlocal after_tool
        last = kw["messages"][-1]
        if last["role"] == "user" and last["content"] == "remind me":
            args = {"action": "add", "at": at, "message": "DISCARDED-REMINDER"}
            return LLMResponse(tool_calls=[ToolCallRequest("c1", "cron", args)])
        if last["role"] == "tool":
            after_tool += 1
            if after_tool == 1:
                raise RuntimeError("the first attempt dies after its tool call")
            rerun.set()
            await never.wait()  # the re-run runs until the discard cancels it
        return LLMResponse(content="ok")

    make_loop(ScriptedProvider(handler=model), followup_mode="queue")
    client = FrontendClient(redis)
    assert (await client.ask(_durable("dr", "hello", "m0"), timeout_s=10)).type == "message"
    sent = await client.send(_durable("dr", "remind me", "m1"))
    await asyncio.wait_for(rerun.wait(), 10)  # the re-run, past the replayed call
    assert await redis.smembers(K.crons("web:dr"))  # (added by the first attempt)
    await client.discard("web:dr")
    got = await collect(client, "web", {sent}, timeout_s=10)
    assert [e.code for e in got[sent] if e.is_terminal] == ["cancelled"]
    assert not await redis.smembers(K.crons("web:dr")), (
        "the discarded turn's schedule (added by its first attempt, replayed by the "
        "re-run) stays and will fire"
    )
