"""TurnJournal: a durable turn's tool exchanges, recorded as they happen and fenced by its
lease (``lua/journal.lua``), so that when the worker dies and the entry is delivered
again, the new attempt replays them instead of running the tools a second time.

What is recorded: each assistant row with tool calls (before any of its calls runs) and
each tool result (as soon as it is known). A call whose result is missing from the journal
may or may not have run; the re-run decides by the tool's ``idempotent`` flag
(``worker.agent.runner``). Private sessions keep no journal: their text stays in their
owner's memory, and their owner's death ends them anyway. The journal is read only on a
redelivery, and dropped by the commit of a turn that wrote (or replayed) one, in the same
script: a journal outlives its turn only when the turn is never committed (TTL 1 day, and
the next entry under the lease starts afresh).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from redis.exceptions import OutOfMemoryError

from bus_redis import RedisBus
from bus_redis.codec import safe
from bus_redis.journal import JournalStore
from session_store.codec import readable_rows
from worker.agent.runner import journaled_calls
from worker.agent.tools.base import Origin, Services
from worker.runtime.backoff import while_full
from worker.runtime.outcomes import TurnAbortedError

log = logging.getLogger(__name__)


class TurnJournal:
    def __init__(
        self,
        bus: RedisBus,
        key: str,
        token: str,
        member: str,
        entry_id: str,
        holds: Callable[[], bool],
    ) -> None:
        self.store = JournalStore(bus)
        self.key = key  # the effective key: one turn runs under its lease at a time
        self.token = token
        self.entry = f"{member}|{entry_id}"
        self.holds = holds  # its lease's term not over
        self.written = False

    async def record(self, rows: list[dict[str, Any]]) -> None:
        """Append rows; a lost lease ends the turn before another tool can run. A full
        Redis is waited out while the lease holds: the turn pauses, its message is not
        failed for it (no delivery spent, never dead-lettered for it)."""
        encoded = [json.dumps(r, ensure_ascii=False, default=str) for r in rows]
        try:
            written = await while_full(
                "a tool journal's write", log, self.holds,
                lambda: self.store.append(self.key, self.token, self.entry, encoded),
            )  # fmt: skip
        except OutOfMemoryError:
            raise TurnAbortedError("lease_lost") from None  # refused until the term ended
        if written < 0:
            raise TurnAbortedError("lease_lost")
        self.written = True

    async def replay(self) -> list[dict[str, Any]]:
        """The rows a lost attempt of this entry recorded (a redelivery)."""
        rows = readable_rows(await self.store.read(self.key, self.entry))
        self.written = self.written or bool(rows)
        return rows

    async def drop(self) -> None:
        """Drop the journal of this entry (the commit does it for a committed turn)."""
        await self.store.append(self.key, self.token, self.entry, [])


async def undo_journaled(bus: RedisBus, services: Services | None, origin: Origin) -> int:
    """The turn of ``origin``'s entry will never be committed (dead-lettered, or cancelled
    before its re-run): the outside effects its lost attempts journaled (a schedule added,
    a subagent spawned) are undone, the newest first, fenced by the lease it ran under
    (``origin.lease_key``), as a discard of a running turn undoes them. Its calls are
    named as its re-run would name them (``<session>|<entry>#<n>``). How many were undone."""
    if services is None or not origin.entry_id:
        return 0
    turn = f"{origin.member}|{origin.entry_id}"
    rows = readable_rows(await JournalStore(bus).read(origin.lease_key, turn))
    undos = [
        undo
        for n, (name, args) in enumerate(journaled_calls(rows), 1)
        if (undo := services.undo_of(name, args, origin, f"{turn}#{n}")) is not None
    ]
    for undo in reversed(undos):
        try:
            await undo()
        except Exception as exc:  # one failed undo must not keep the others from running
            log.warning("undoing an effect of %s failed: %s", safe(turn), type(exc).__name__)
    return len(undos)
