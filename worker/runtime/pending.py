"""A turn that ended at its last model boundary and left what arrived meanwhile to its
commit (``FollowUpPuller.defer``): the commit refuses (``Late``) when a payload entry came
after the last one the turn read; then the session forgets the rows the outcome added and
the turn goes on (``TurnRunner.go_on``) to its next outcome."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from bus_redis import InboundMessage
from session_store import Session
from worker.agent.runner import TurnState
from worker.agent.tools import ToolContext
from worker.runtime.context import Runtime
from worker.runtime.followups import FollowUpPuller
from worker.runtime.journal import TurnJournal

if TYPE_CHECKING:
    from worker.runtime.execution import Outcome


@dataclass(slots=True)
class Running:
    """A turn's task and what its outcome is made of."""

    task: asyncio.Task[str]
    msg: InboundMessage
    session: Session
    state: TurnState
    reply_to: str
    ctx: ToolContext
    puller: FollowUpPuller | None
    journal: TurnJournal | None


class Settles(Protocol):
    rt: Runtime

    async def settle(self, turn: Running) -> Outcome: ...


@dataclass(slots=True)
class Pending:
    """The outcome of ``turn``, to be committed with ``late_after``."""

    execution: Settles
    turn: Running
    mark: tuple[int, list[tuple[str, str]], str]  # the session before the outcome's rows
    late_after: str  # the last entry the turn read of its stream

    async def go_on(self) -> Outcome:
        """The commit was refused: the turn reads what arrived and goes on."""
        turn = self.turn
        turn.session.rollback(self.mark)
        turn.task = asyncio.create_task(self.execution.rt.runner.go_on(turn.state))
        return await self.execution.settle(turn)
