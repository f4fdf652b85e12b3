"""An in-process turn (``AgentLoop.process_message``) held in its model call until a control
cuts it, for tests of what cancels it."""

from __future__ import annotations

import asyncio
from typing import Any

from bus_redis import OutboundMessage


async def in_process_turn(
    make_loop: Any,
    monkeypatch: Any,
    ahead_s: float,
    *,
    started: bool = True,
    now_ms: int | None = None,
) -> Any:
    """An in-process turn held until cancelled, its clock ``ahead_s`` before Redis's (or,
    with ``now_ms``, both clocks standing at that millisecond); begun once the loop is
    started (its control subscription made), or at once."""
    import time
    from types import SimpleNamespace

    from helpers import ScriptedProvider

    from bus_redis import InboundMessage
    from worker.agent.providers import LLMResponse
    from worker.runtime import direct

    holding = asyncio.Event()

    async def handler(**_kw: Any) -> LLMResponse:
        holding.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    loop = make_loop(ScriptedProvider(handler=handler))
    if started:
        async with asyncio.timeout(10):
            while loop._consumer is None:  # (created once the start is done)
                await asyncio.sleep(0.01)
    if now_ms is None:
        monkeypatch.setattr(direct, "time", SimpleNamespace(time=lambda: time.time() + ahead_s))
    else:

        async def fixed(_bus: Any) -> int:
            return now_ms

        monkeypatch.setattr(direct, "time", SimpleNamespace(time=lambda: now_ms / 1000))
        monkeypatch.setattr(direct, "redis_now_ms", fixed, raising=False)
    msg = InboundMessage(id="t", channel="web", sender_id="u", chat_id="ms", content="hi")
    turn = asyncio.create_task(loop.process_message(msg))
    await asyncio.wait_for(holding.wait(), 10)
    return loop, turn


async def cancelled(turn: Any, why: str) -> OutboundMessage:
    """The held in-process ``turn``'s reply once a control cut it (``why`` when none did
    within 10 s)."""
    try:
        reply = await asyncio.wait_for(turn, 10)
    except TimeoutError:
        turn.cancel()
        raise AssertionError(why) from None
    assert reply is not None
    assert reply.code == "cancelled"
    return reply
