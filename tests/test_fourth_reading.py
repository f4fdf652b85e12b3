"""A hostile fourth reading of 0337dab..ebacb12, aimed at the fixes of f5ce182..ebacb12
(consolidations queued again with alternating ids and ``tries``, ``commit_full``,
unified-mode firings of a folded chat, ``prune_idle(schedules_of=...)``, ``every``
schedules' ``anchor_ms``). Each test names the defect it shows and the behaviour that is
right; each fails on ebacb12. (A put-off consolidation queued on the in-process job
queue is lost with its worker's restart: ARCHITECTURE, known; its test is not here.)"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import redis.asyncio as aioredis
from helpers import ScriptedProvider
from replies import wait_until_async
from test_consolidation import _last_consolidated

from bus_redis import InboundMessage, Keys, RedisBus
from worker import AgentLoop, LoopConfig
from worker.agent.providers import LLMResponse

K = Keys()
# one consolidation of a channel at a time on the worker; a session is over its budget
# after a few short turns, and every commit from the fifth asks for a consolidation
ONE = LoopConfig(
    consolidate_above_tokens=60, read_block_ms=100, followup_mode="queue",
    consolidations_per_channel=1,
)  # fmt: skip


class _HeldFolds:
    """Folds whose transcript names ``held`` wait for ``release``; the others answer at
    once. Turns are echoed."""

    def __init__(self, held: str) -> None:
        self.held = held
        self.release = asyncio.Event()
        self.holding = 0

    async def __call__(self, **kw: Any) -> LLMResponse:
        messages = kw["messages"]
        if kw.get("tools") is None and "Summarise" in messages[0]["content"]:
            if self.held in messages[-1]["content"]:
                self.holding += 1
                await self.release.wait()
            return LLMResponse(content=json.dumps({"memory": "m", "history": "h"}))
        return LLMResponse(content=f"re: {messages[-1]['content']}")


async def _turn(loop: AgentLoop, chat: str, sender: str, text: str) -> None:
    msg = InboundMessage(channel="web", sender_id=sender, chat_id=chat, content=text)
    await loop.process_message(msg)


async def _rows(redis: aioredis.Redis, key: str) -> int:
    return int(await redis.hget(K.session(key), "count") or 0)


async def test_a_put_off_consolidation_whose_other_id_is_queued_is_not_lost(
    redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defect (``Consolidator._again``, worker/jobs/consolidation.py: the job put off is
    queued under the other id of the session's pair, and a refused enqueue is dropped
    silently): chat B's consolidation (rows up to E0) is put off for the channel's bound
    and waits, deferred, under ``P:consolidate:web:b:again``. B's next turn queues a job
    for rows up to E2 > E0 (base id, free again); it is put off too, and its re-queue
    under ``:again`` is refused: that id is taken by the older, smaller job. The older job
    later folds up to E0 only, and then nothing is queued: rows E0..E2 stay unfolded for
    as long as the chat is quiet (the idle prune later deletes them unfolded). Right: a
    put-off job is not lost to its pair's other id; the rows its commit asked to fold are
    folded without another turn (e.g. the re-queue widens the waiting job's range, or the
    job folds up to the session's current end when it runs)."""
    import worker.jobs.consolidation as consolidation_module

    monkeypatch.setattr(consolidation_module, "AGAIN_AFTER_S", 1.0)  # (not 30 s)
    model = _HeldFolds("alpha")
    loop = AgentLoop(RedisBus(redis), ScriptedProvider(handler=model), config=ONE)
    try:
        for i in range(5):  # chat a's consolidation holds the channel's one slot
            await _turn(loop, "a", "ua", f"alpha {i} " * 12)

        async def a_folds() -> bool:
            return model.holding >= 1

        assert await wait_until_async(a_folds, timeout_s=10)
        for i in range(5):  # chat b's first job (rows up to E0) is put off: ":again"
            await _turn(loop, "b", "ub", f"beta {i} " * 12)
        await _turn(loop, "b", "ub", "beta 5 " * 12)  # its next job (up to E2): put off
        wanted = await _rows(redis, "web:b") - consolidation_module.KEEP_RECENT  # E2
        model.release.set()  # the channel's slot is free; chat b says nothing more

        async def folded_e0() -> bool:
            return await _last_consolidated(redis, "web:b") > 0

        assert await wait_until_async(folded_e0, timeout_s=10)

        async def folded_all() -> bool:
            return await _last_consolidated(redis, "web:b") >= wanted

        assert await wait_until_async(folded_all, timeout_s=6), (
            f"chat b's rows {await _last_consolidated(redis, 'web:b')}..{wanted} were never "
            "folded: their put-off job's re-queue was refused (its pair's other id held an "
            "older, smaller job)"
        )
    finally:
        model.release.set()
        await loop.jobs.aclose()
