"""Flood and fairness: what one channel (or one user behind a gateway) writes must not
make the worker do work or hold memory in proportion to it, nor keep another channel
from being served (docs/ARCHITECTURE.md, "Bounded work: what one channel can cost
another"). Each test floods one channel and asserts what the other channel got, or that
what the worker holds does not grow with the flood; never timings. Each test failed on
8d4907a (a hostile review: consolidations had no per-channel bound)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import redis.asyncio as aioredis
from helpers import ScriptedProvider
from replies import collect, wait_until_async

from bus_redis import FrontendClient, InboundMessage, RedisBus
from worker import AgentLoop, LoopConfig
from worker.agent.providers import LLMResponse, ToolCallRequest
from worker.jobs.arq_queue import ArqJobQueue

# a session is over its consolidation budget after a few short turns (as in
# tests/test_consolidation.py); a turn per message
LOW = LoopConfig(consolidate_above_tokens=60, read_block_ms=100, followup_mode="queue")
ARQ_JOB_SLOTS = 32  # ArqJobQueue's max_jobs: what one worker runs at once


class Model:
    """Folds of consolidation (the "Summarise" prompt) wait for ``release``, counted while
    they wait; "research ..." spawns a subagent, whose start is recorded; the rest is
    echoed."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.folding = 0  # consolidation model calls in flight
        self.folds = 0  # ... started in all
        self.subagent_started = asyncio.Event()
        self.spawns = 0

    async def __call__(self, **kw: Any) -> LLMResponse:
        messages = kw["messages"]
        last = messages[-1]
        if kw.get("tools") is None and "Summarise" in messages[0]["content"]:
            self.folding += 1
            self.folds += 1
            try:
                await self.release.wait()
            finally:
                self.folding -= 1
            return LLMResponse(content=json.dumps({"memory": "m", "history": "h"}))
        if last["role"] == "user" and str(last["content"]).startswith("research"):
            self.spawns += 1
            call = ToolCallRequest(f"c{self.spawns}", "spawn", {"task": "look", "label": "r"})
            return LLMResponse(tool_calls=[call])
        if last["role"] == "user" and str(last["content"]).startswith("Task"):
            self.subagent_started.set()
            return LLMResponse(content="found: 42")
        return LLMResponse(content=f"re: {last['content']}")


async def _long_sessions(loop: AgentLoop, channel: str, n: int) -> None:
    """``n`` sessions of ``channel`` over the consolidation budget: each of their commits
    asks for a consolidation job (one per session: the job id is the session's)."""
    for s in range(n):
        for i in range(5):
            msg = InboundMessage(
                channel=channel, sender_id=f"u{s}", chat_id=f"long{s}", content=f"fact {i} " * 12
            )
            await loop.process_message(msg)


@pytest.mark.real_redis
async def test_one_channels_consolidations_cannot_take_every_job_slot_from_another_channel(
    real_redis: aioredis.Redis, redis_server: Any
) -> None:
    """Defect: consolidation jobs have a per-session dedup (job id ``P:consolidate:<K>``)
    but no per-channel bound, unlike subagents (``AGENT_SUBAGENT_SESSIONS_PER_CHANNEL``,
    "so a channel cannot fill arq's queue or every worker's job slots") and schedules.
    A channel with more long sessions than arq's 32 job slots fills every slot with its
    consolidations (each a model call, up to 8 a job) and queues the rest ahead of
    everyone else's jobs: another channel's subagent is queued behind them and does not
    start while they run. Correct: one channel's consolidations hold a bounded share of
    the job slots, so another channel's subagent starts."""
    model = Model()
    jobs = ArqJobQueue(redis_server.url, "agent")
    loop = AgentLoop(RedisBus(real_redis), ScriptedProvider(handler=model), jobs=jobs, config=LOW)
    task = asyncio.create_task(loop.run())
    client = FrontendClient(aioredis.from_url(redis_server.url, decode_responses=True))
    try:
        await _long_sessions(loop, "web", ARQ_JOB_SLOTS + 8)

        async def slots_full() -> bool:  # (before: all 32 slots; now: web's share)
            return model.folding >= min(ARQ_JOB_SLOTS, LOW.consolidations_per_channel)

        assert await wait_until_async(slots_full, timeout_s=30)
        other = InboundMessage(
            id="o1", channel="cli", chat_id="b", sender_id="v", content="research quick"
        )
        await client.send(other)
        await collect(client, "cli", {"o1"}, timeout_s=20)  # spawned: its job is queued

        async def started() -> bool:
            return model.subagent_started.is_set()

        assert await wait_until_async(started, timeout_s=15), (
            f"cli's subagent never started: web's consolidations hold {model.folding} of "
            f"the {ARQ_JOB_SLOTS} job slots"
        )
    finally:
        model.release.set()
        loop.stop()
        await asyncio.wait_for(task, 30)
        await client.redis.aclose()


async def test_one_channels_consolidations_in_flight_do_not_grow_with_its_sessions(
    redis: aioredis.Redis,
) -> None:
    """Defect: with the in-process job queue (``AGENT_JOBS=local``, and every embedded
    ``AgentLoop``) each consolidation job is an asyncio task started at once: no slot
    bound (arq's is 32 a worker) and no per-channel one. A channel with N long sessions
    makes the worker run N consolidations at once (N model calls in flight, N loaded
    snapshots of their rows held), however large N. Correct: what one channel's
    consolidations run (and hold) at once is bounded, not one per session it wrote."""
    model = Model()
    loop = AgentLoop(RedisBus(redis), ScriptedProvider(handler=model), config=LOW)
    try:
        await _long_sessions(loop, "web", 48)

        limit = LOW.consolidations_per_channel

        async def settled() -> bool:  # every job folding, or left (a bound in place)
            jobs = loop.jobs
            running = len(jobs._running) - len(jobs._waiting)  # type: ignore[attr-defined]
            left = running <= limit  # (the rest put off: queued for later, not running)
            return model.folds >= 48 or (model.folding >= limit and left)

        await wait_until_async(settled, timeout_s=10)
        assert model.folding <= LOW.consolidations_per_channel, (
            f"{model.folding} consolidations of one channel run at once"
        )
    finally:
        model.release.set()
        await loop.jobs.aclose()


async def test_one_users_long_chats_take_one_fold_not_the_channels_share(
    redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A channel's consolidations are bounded (``AGENT_CONSOLIDATIONS_PER_CHANNEL``), but
    one user (one scope) with more long chats than that took the whole share: another
    user's consolidation in the same channel (a gateway's) was left while they ran, and
    the user's own folds made each other's work void (one memory: each fold after the
    first is made again from the memory the first wrote). Now a scope folds one part at
    a time on a worker; its other jobs are put off, and run later without another turn."""
    from test_consolidation import _last_consolidated

    import worker.jobs.consolidation as consolidation_module

    monkeypatch.setattr(consolidation_module, "AGAIN_AFTER_S", 0.05)  # (not 30 s)
    model = Model()
    folds: list[str] = []

    async def recorded(**kw: Any) -> LLMResponse:
        if kw.get("tools") is None and "Summarise" in kw["messages"][0]["content"]:
            folds.append(json.dumps(kw["messages"]))
        return await model(**kw)

    loop = AgentLoop(RedisBus(redis), ScriptedProvider(handler=recorded), config=LOW)
    try:
        await _long_sessions(loop, "web", 1)  # user u0's chat long0
        for i in range(5):  # five more chats of u0 (one scope)
            for n in range(5):
                msg = InboundMessage(
                    channel="web", sender_id="u0", chat_id=f"more{i}", content=f"fact {n} " * 12
                )
                await loop.process_message(msg)
        other = [
            InboundMessage(channel="web", sender_id="v", chat_id="v1", content=f"v {n} " * 12)
            for n in range(5)
        ]
        for msg in other:  # another user of the channel, last
            await loop.process_message(msg)

        async def others_fold() -> bool:
            return any("v 0" in f for f in folds)

        assert await wait_until_async(others_fold, timeout_s=10), (
            f"{model.folding} folds of one user run: the other user's consolidation was left"
        )
        assert model.folding == 2  # u0's one and v's one
        model.release.set()  # the chats say nothing more: the folds put off run later

        async def all_folded() -> bool:
            keys = ["web:long0", *(f"web:more{i}" for i in range(5)), "web:v1"]
            return all([await _last_consolidated(redis, k) > 0 for k in keys])

        assert await wait_until_async(all_folded, timeout_s=15), "a put-off fold never ran"
    finally:
        model.release.set()
        await loop.jobs.aclose()


# --- a bot's end users and the channel's consolidation share (a helper's attack, stop 52) ----------------------------------


async def test_a_bots_end_users_do_not_take_the_channels_whole_consolidation_share(
    redis: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Promise (README, ``AGENT_CONSOLIDATIONS_PER_CHANNEL``): a worker runs 4
    consolidations of a channel at once, "of which one folds into a given scope's
    memory ... so one channel's long sessions never take every job slot, nor one user's
    long chats the channel's share". Behind the gateway every OpenAI ``user`` field is a
    scope of its own (``user-<h>-oa-<digest>``, quota the caller's ``user-<h>``), and the
    fold bound is kept per *scope*, never per quota: one gateway user (a bot) whose
    four end users have long chats holds all 4 of the channel's folds, and another
    gateway user's consolidation is put off for as long as they run (README: the quota
    keeps a bot's end users to "the caller's one share" for schedules and subagents
    only). The messages are exactly those ``Gateway.message`` writes for the two users."""
    from helpers import ScriptedProvider
    from replies import wait_until_async

    import worker.jobs.consolidation as consolidation_module
    from bus_redis import InboundMessage, RedisBus
    from gateway.auth import User
    from gateway.chats import end_user_digest
    from worker import AgentLoop

    monkeypatch.setattr(consolidation_module, "AGAIN_AFTER_S", 0.05)  # (not 30 s)
    model = Model()
    folds: list[str] = []

    async def recorded(**kw: Any) -> Any:
        if kw.get("tools") is None and "Summarise" in kw["messages"][0]["content"]:
            folds.append(json.dumps(kw["messages"]))
        return await model(**kw)

    bot, other = User("bot"), User("carol")
    loop = AgentLoop(RedisBus(redis), ScriptedProvider(handler=recorded), config=LOW)
    try:
        for end_user in ("e1", "e2", "e3", "e4", "e5"):  # the bot's end users' chats
            digest = end_user_digest(end_user)
            for n in range(5):
                await loop.process_message(InboundMessage(
                    channel="web", sender_id=bot.id, chat_id=f"{bot.hash}-oa-{digest}",
                    content=f"{end_user} fact {n} " * 12,
                    scope=f"user-{bot.hash}-oa-{digest}", quota=f"user-{bot.hash}",
                ))  # fmt: skip
        for n in range(5):  # another gateway user's chat, last
            await loop.process_message(InboundMessage(
                channel="web", sender_id=other.id, chat_id=f"{other.hash}-{'ab' * 12}",
                content=f"carol {n} " * 12, scope=f"user-{other.hash}",
            ))  # fmt: skip

        async def others_fold() -> bool:
            return any("carol 0" in f for f in folds)

        assert await wait_until_async(others_fold, timeout_s=10), (
            f"{model.folding} folds of one gateway user's end users run at once "
            f"(the channel's share: {LOW.consolidations_per_channel}); the other user's "
            f"consolidation was put off behind them"
        )
    finally:
        model.release.set()
        await loop.jobs.aclose()
