"""Mid-turn injection: messages of the same session that arrive while its turn runs are
pulled into the turn between tool rounds (as the reference loop does), in publish order.

The first entry that cannot join (unreadable, a control marker, an ``open_transient`` op,
a system message, a message of another scope, a message whose mode is not ``inject``:
its own ``followup``, else ``AGENT_FOLLOWUP_MODE``, a message id answered before this
turn) stops the pull; it and everything
after it get their own turns.

At the last model boundary of a durable session's turn, the stream is not read in a round
trip of its own (``defer``): the turn ends there with its answer, and the commit refuses
when a payload entry arrived after the last one read (``CommitSpec.late_after``). Only
then is the stream read, and the turn goes on with what joins (``TurnRunner.go_on``), or
ends as it was when nothing does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bus_redis import InboundMessage, MessageRejectedError, RedisBus, decode_inbound
from session_store import Session
from worker.agent.messages import is_duplicate, message_key, user_row


class FollowUpPuller:
    def __init__(
        self,
        bus: RedisBus,
        session: Session,
        member: str,
        after_id: str,
        *,
        max_bytes: int,
        per_pull: int,
        scope_of: Callable[[InboundMessage], str],
        folded: bool = False,
        stopping: Callable[[], bool] = lambda: False,
        default_mode: str = "inject",
        seen: set[str] | None = None,
    ) -> None:
        self.bus = bus
        self.session = session
        self.member = member
        self.after_id = after_id
        self.max_bytes = max_bytes
        self.per_pull = per_pull
        self.scope_of = scope_of
        self.folded = folded
        self.stopping = stopping  # a worker shutting down takes no new work into a turn
        self.default_mode = default_mode  # AGENT_FOLLOWUP_MODE; a message may name its own
        self.injected: list[tuple[str, str]] = []  # (entry id, reply_to), consumed by the turn
        # the user rows of this turn so far (its own, those joined): not in the session
        # until the commit, so a message sent again meanwhile is known by these
        self.seen = set(seen or ())
        self._closed = False
        self._deferred = False  # the commit reads at the last model boundary

    def defer(self) -> None:
        """From now on, the last model boundary leaves the read to the commit."""
        self._deferred = True

    def deferred(self) -> bool:
        return self._deferred and not self._closed and not self.stopping()

    async def __call__(self) -> list[dict[str, Any]]:
        if self._closed or self.stopping():
            return []
        rows: list[dict[str, Any]] = []
        for entry_id, payload in await self.bus.peek(
            self.member, after=self.after_id, count=self.per_pull
        ):
            msg = self._joinable(payload)
            reply_to = "" if msg is None else msg.id or entry_id
            row_id = "" if msg is None else message_key(msg, reply_to, folded=self.folded)
            again = msg is not None and bool(msg.id) and row_id in self.seen
            if msg is None or (not again and is_duplicate(msg, self.session, row_id)):
                # (one answered before this turn: its own turn answers it `duplicate`)
                self._closed = True
                break
            self.injected.append((entry_id, reply_to))
            self.after_id = entry_id
            if not again:  # (sent again while this turn answers it: consumed, no new row)
                rows.append(user_row(msg, row_id))
                self.seen.add(row_id)
        return rows

    def _joinable(self, payload: str | None) -> InboundMessage | None:
        if payload is None:  # a control marker
            return None
        try:
            msg = decode_inbound(payload, max_bytes=self.max_bytes)
        except MessageRejectedError:
            return None
        if not isinstance(msg, InboundMessage) or not msg.is_user_input:
            return None
        if msg.session_key != self.member or self.scope_of(msg) != self.session.scope:
            return None
        if msg.require_existing_session and self.session.policy.persist:
            return None  # (a private one's: never a durable turn's, never stored)
        if (msg.followup or self.default_mode) != "inject":  # queue: a turn of its own
            return None
        return msg
