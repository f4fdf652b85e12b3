"""How a turn's execution waits for its turn task (``TurnExecution._await_turn``): a
control that cancels the turn leaves the execution running (it makes the ``cancelled``
outcome); a cancellation of the execution itself (shutdown, a lost lease's holder) cancels
the turn, waits for it to end, and propagates, even when the turn swallowed its own
cancellation. Synchronised on events, never on time."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from worker.runtime.execution import TurnExecution
from worker.runtime.inflight import TurnRegistry

KEY = "web:c1"


def _execution() -> tuple[TurnExecution, TurnRegistry]:
    turns = TurnRegistry()
    holder: Any = SimpleNamespace(rt=SimpleNamespace(turns=turns), key=KEY, slot=None)
    return TurnExecution(holder), turns


async def _blocked(started: asyncio.Event, *, swallow: bool = False, ended: list[str]) -> str:
    started.set()
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        ended.append("cancelled")
        if not swallow:
            raise
    return "swallowed"


async def test_a_control_cancels_the_turn_and_the_execution_goes_on() -> None:
    execution, turns = _execution()
    execution.holder.slot = turns.begin(KEY, KEY, "1-0")
    started, ended = asyncio.Event(), []
    task = asyncio.create_task(_blocked(started, ended=ended))
    waiting = asyncio.create_task(execution._await_turn(task))
    await started.wait()
    assert turns.cancel(KEY, "stop") == 1
    assert await waiting == "stop"  # the reason, not a CancelledError
    assert task.cancelled()
    assert ended == ["cancelled"]


async def test_a_failed_turn_is_returned_to_its_outcome() -> None:
    execution, turns = _execution()
    execution.holder.slot = turns.begin(KEY, KEY, "1-0")

    async def fails() -> str:
        raise ValueError("boom")

    task = asyncio.create_task(fails())
    assert await execution._await_turn(task) is None
    assert isinstance(task.exception(), ValueError)


@pytest.mark.parametrize("swallow", [False, True])
async def test_cancelling_the_execution_cancels_the_turn_and_propagates(swallow: bool) -> None:
    execution, turns = _execution()
    execution.holder.slot = turns.begin(KEY, KEY, "1-0")
    started, ended = asyncio.Event(), []
    task = asyncio.create_task(_blocked(started, swallow=swallow, ended=ended))
    waiting = asyncio.create_task(execution._await_turn(task))
    await started.wait()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert ended == ["cancelled"]  # the turn saw its cancellation and ended first
    assert task.done()


async def test_an_execution_cancelled_before_it_waits_still_cancels_the_turn() -> None:
    """The cancel request arrives while the turn is already over (no suspension)."""
    execution, turns = _execution()
    execution.holder.slot = turns.begin(KEY, KEY, "1-0")

    async def quick() -> str:
        return "done"

    task = asyncio.create_task(quick())
    await asyncio.wait({task})

    async def run() -> str | None:
        me = asyncio.current_task()
        assert me is not None
        me.cancel()  # pending: raised at the next suspension, or noticed by the count
        return await execution._await_turn(task)

    with pytest.raises(asyncio.CancelledError):
        await asyncio.create_task(run())
