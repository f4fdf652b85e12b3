"""TurnExecution: one message's turn while its session's lease is held: load the session,
run the LLM/tool loop as its own task (so controls can cancel it), and turn the result
(or the cancellation) into an Outcome the holder commits."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from bus_redis import SESSION_NOT_ACTIVE, InboundMessage, OutboundMessage
from bus_redis.results import owner_member
from session_store import UNIFIED_SESSION_KEY, Session
from worker.followups import FollowUpPuller
from worker.outcomes import SessionNotActiveError, TurnAbortedError, error, legal_prefix, reply
from worker.providers import ProviderError
from worker.tools import ToolContext
from worker.turn import TurnState, user_row

if TYPE_CHECKING:
    from worker.holder import SessionHolder

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Outcome:
    reply: OutboundMessage | None
    session: Session | None = None  # persist its unpersisted rows when durable
    injected: list[tuple[str, str]] = field(default_factory=list)  # (entry id, reply_to)


class TurnExecution:
    def __init__(self, holder: SessionHolder) -> None:
        self.holder = holder
        self.loop = holder.loop
        self.key = holder.key

    async def _session(self, msg: InboundMessage) -> Session:
        """The transient session this worker owns, or the durable session at the leased
        version. ``require_existing_session`` is met only by a live (transient) session:
        stored history is never a fallback, whichever worker runs the turn."""
        sessions = self.loop.sessions
        transient = sessions.get_cached(self.key) if sessions.is_transient(self.key) else None
        if transient is not None:
            self.loop.owned.setdefault(self.key, owner_member(self.key, msg.channel, msg.chat_id))
            return transient
        if msg.require_existing_session:
            raise SessionNotActiveError(SESSION_NOT_ACTIVE)
        return await sessions.load_for_turn(self.key, self.holder.version)

    async def run(
        self, msg: InboundMessage, *, reply_to: str, member: str, entry_id: str = ""
    ) -> Outcome:
        session = await self._session(msg)
        if msg.id and session.has_seen(msg.id):
            log.info("duplicate message %s in %s skipped", msg.id, self.key)
            return Outcome(reply=None)
        memory = None
        if session.policy.persist:
            memory = await self.loop.memory.read_cached(self.holder.memory_version)
        state = TurnState()
        ctx = ToolContext(
            session, self.loop.sessions, emit=lambda text: self._emit(msg, reply_to, text)
        )
        row = user_row(msg, reply_to)
        puller = self._puller(session, member, entry_id)
        on_delta = None
        if self.loop.config.stream_deltas:
            on_delta = lambda text: self._emit(msg, reply_to, text, kind="delta")  # noqa: E731
        turn = self.loop.runner.run(session, row, memory, ctx, state, puller, on_delta)
        task = asyncio.create_task(turn)
        reason = await self._await_turn(task, member, entry_id)
        outcome = await self._outcome(task, reason, msg, session, state, reply_to)
        if puller is not None and puller.injected:
            outcome.injected = puller.injected
            if outcome.reply is not None:
                outcome.reply.covers = [reply_to, *(r for _, r in puller.injected)]
        return outcome

    def _puller(self, session: Session, member: str, entry_id: str) -> FollowUpPuller | None:
        cfg = self.loop.config
        if not entry_id or cfg.followup_mode != "inject":
            return None
        return FollowUpPuller(
            self.loop.bus,
            session,
            member,
            entry_id,
            max_bytes=cfg.max_payload_bytes,
            per_pull=cfg.followups_per_pull,
        )

    async def _await_turn(self, task: asyncio.Task[str], member: str, entry_id: str) -> str | None:
        loop = self.loop
        loop.active_tasks.setdefault(self.key, set()).add(task)
        loop.active_members[self.key] = member
        loop.since_ms[self.key] = int(time.time() * 1000)
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:
            loop.cancel_reasons.setdefault(task, "shutdown")
            task.cancel()
            await asyncio.wait({task})
        finally:
            tasks = loop.active_tasks.get(self.key)
            if tasks is not None:
                tasks.discard(task)
                if not tasks:
                    loop.active_tasks.pop(self.key, None)
        return loop.cancel_reasons.pop(task, None)

    async def _outcome(
        self,
        task: asyncio.Task[str],
        reason: str | None,
        msg: InboundMessage,
        session: Session,
        state: TurnState,
        reply_to: str,
    ) -> Outcome:
        key = self.key
        if task.cancelled() or reason in ("lease_lost", "shutdown"):
            if reason in (None, "lease_lost", "shutdown"):
                raise TurnAbortedError(reason or "cancelled")
            if reason == "stop":
                session.append_rows(legal_prefix(state.rows))
            out = error(
                msg.channel, msg.chat_id, key, reply_to, "cancelled", f"turn cancelled by {reason}"
            )
            return Outcome(out, session if reason == "stop" else None)
        exc = task.exception()
        if isinstance(exc, ProviderError):
            session.append_rows(state.rows[:1])
            detail = exc if session.policy.log_content else type(exc.__cause__ or exc).__name__
            log.warning("provider error in %s: %s", key, detail)
            return Outcome(
                error(msg.channel, msg.chat_id, key, reply_to, "provider_error", str(exc)), session
            )
        if exc is not None:
            raise exc
        session.append_rows(state.rows)
        if key == UNIFIED_SESSION_KEY:  # where the shared session last spoke, under the lease
            session.metadata["last_channel"] = f"{msg.channel}:{msg.chat_id}"
        out = reply(msg, key, reply_to, task.result(), metadata={"worker": self.loop.worker_id})
        return Outcome(out, session)

    async def _emit(
        self, msg: InboundMessage, reply_to: str, text: str, *, kind: str = "progress"
    ) -> None:
        """A fenced non-terminal event: ``progress`` (message tool) or ``delta``."""
        out = OutboundMessage(
            type=kind,
            channel=msg.channel,
            chat_id=msg.chat_id,
            session_key=self.key,
            reply_to=reply_to,
            content=text,
            metadata={"tool": "message"} if kind == "progress" else {},
        )
        if not await self.loop.bus.emit(
            self.key, self.holder.token, msg.channel, out.model_dump_json(exclude_none=True)
        ):
            self.loop.metrics["fenced_writes_rejected"] += 1
