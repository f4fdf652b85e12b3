"""TurnExecution: one message's turn while its session's lease is held: load the session,
check scope and duplicates, run the LLM/tool loop as its own task (so controls can cancel
it), and turn the result (or the cancellation) into an Outcome the holder commits."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

from redis.exceptions import OutOfMemoryError

from bus_redis import SESSION_NOT_ACTIVE, InboundMessage, OutboundMessage
from bus_redis.codec import safe
from bus_redis.results import Ahead, owner_member
from session_store import UNIFIED_SESSION_KEY, Session
from worker.agent.messages import is_duplicate, is_unanswered_retry, message_key, user_row
from worker.agent.providers import ProviderError
from worker.agent.runner import TurnState
from worker.agent.tools import ToolContext
from worker.agent.tools.base import Origin
from worker.runtime.context import Runtime
from worker.runtime.followups import FollowUpPuller
from worker.runtime.inflight import Slot
from worker.runtime.journal import TurnJournal
from worker.runtime.outcomes import (
    SessionNotActiveError,
    TurnAbortedError,
    error,
    legal_prefix,
    reply,
)
from worker.runtime.pending import Pending, Running
from worker.runtime.scopes import check_scope

log = logging.getLogger(__name__)
KEEPS_WORK = ("stop", "interrupt")  # cancellations that keep the turn's complete exchanges
RESUMED_NOTE = (
    "\n\n(This answer was resumed after the worker running it stopped. Not repeated, "
    "so whether they took effect is unknown: {tools}.)"
)


class Held(Protocol):
    """What a turn needs of the lease it runs under (``SessionHolder`` is one): the key
    and token its writes are fenced by, the session version and generation acquire read,
    and the memory version it may refresh; the rows acquire read for a cached copy that
    was behind (``ahead``), which the first turn uses."""

    rt: Runtime
    key: str
    token: str
    version: int
    generation: str
    ahead: Ahead | None
    memory_scope: str
    memory_version: int
    slot: Slot | None  # the entry it handles (a control or a lost lease cancels that one)

    @property
    def transient(self) -> bool: ...

    def holds(self) -> bool:
        """Whether its lease still holds (``Lease.holds``): looked at before each model
        call and tool call."""
        ...


@dataclass(slots=True)
class Outcome:
    reply: OutboundMessage | None
    session: Session | None = None  # persist its unpersisted rows when durable
    injected: list[tuple[str, str]] = field(default_factory=list)  # (entry id, reply_to)
    tokens: tuple[int, int] = (0, 0)  # in, out (the turn's log line)
    journal: TurnJournal | None = None  # dropped once the turn is committed
    # the turn ended at its last model boundary, what arrived left to the commit: commit
    # with ``late_after``; when that is refused, ``go_on()`` gives the next outcome
    pending: Pending | None = None


class TurnExecution:
    def __init__(self, holder: Held) -> None:
        self.holder = holder
        self.rt = holder.rt
        self.key = holder.key
        self.member = ""
        self._seq = 0  # of this turn's non-terminal events (makes a retried emit idempotent)

    async def _session(self, msg: InboundMessage) -> Session:
        """The transient session this worker owns, or the durable session at the leased
        version. ``require_existing_session`` is met only by a live (transient) session:
        stored history is never a fallback, whichever worker runs the turn."""
        sessions = self.rt.sessions
        transient = sessions.get_cached(self.key) if sessions.is_transient(self.key) else None
        if transient is not None and self.rt.turns.is_closing(self.key):
            raise SessionNotActiveError(SESSION_NOT_ACTIVE)  # its loss is being reported
        if transient is not None:
            if not self.rt.turns.owns(self.key):
                self.rt.turns.own(self.key, owner_member(self.key, msg.channel, msg.chat_id))
            self.rt.turns.touch(self.key)
            return transient
        if msg.require_existing_session:
            raise SessionNotActiveError(SESSION_NOT_ACTIVE)
        holder = self.holder
        ahead, holder.ahead = holder.ahead, None  # read for the version acquire saw
        return await sessions.load_for_turn(self.key, holder.version, holder.generation, ahead)

    async def _memory(self, session: Session) -> str | None:
        """The scope's memory at the version acquire read (no round trip while cached);
        read once per lease when acquire did not know the scope (the session was not
        cached), then the rest of the holder's turns use that version, as they would."""
        if not session.policy.persist:
            return None
        holder, memory = self.holder, self.rt.memory
        if holder.memory_scope == session.scope:
            return await memory.read_cached(holder.memory_version, session.scope)
        text = await memory.read_memory(session.scope)
        holder.memory_scope, holder.memory_version = session.scope, memory.version(session.scope)
        return text

    def _duplicate(
        self, msg: InboundMessage, session: Session, reply_to: str, row_id: str
    ) -> Outcome:
        """A re-sent id: the original answer while it is known, else a ``duplicate`` error."""
        log.info("duplicate message %s in %s answered again", safe(msg.id), safe(self.key))
        answer = session.answer_to(row_id)
        if answer is None:
            detail = "this message id was already processed; its answer is no longer kept"
            return Outcome(
                error(msg.channel, msg.chat_id, self.member, reply_to, "duplicate", detail)
            )
        meta = {**msg.metadata, "duplicate": True}
        return Outcome(reply(msg, self.member, reply_to, answer, metadata=meta))

    async def run(
        self,
        msg: InboundMessage,
        *,
        reply_to: str,
        member: str,
        entry_id: str = "",
        attempts: int = 1,
    ) -> Outcome:
        self.member = member or self.key
        session = await self._session(msg)
        check_scope(self.rt, msg, session, entry_id)
        if self.holder.slot is not None:  # (what an interrupt's check compares with)
            self.rt.turns.set_scope(self.holder.slot, session.scope)
        row_id = message_key(msg, reply_to, folded=self.member != self.key)
        retry = is_unanswered_retry(msg, session, row_id)
        if not retry and is_duplicate(msg, session, row_id):
            return self._duplicate(msg, session, reply_to, row_id)
        memory = await self._memory(session)
        state = TurnState(held=self.holder.holds)
        journal = None
        if entry_id and session.policy.persist:
            holder = self.holder
            journal = TurnJournal(
                self.rt.bus, self.key, holder.token, self.member, entry_id, holder.holds
            )
            state.journal = journal
            if attempts > 1:  # a redelivery: what the lost attempt did comes first
                state.replayed = await journal.replay()
        ctx = ToolContext(
            session,
            self.rt.sessions,
            emit=lambda text: self._emit(msg, reply_to, text),
            metadata=dict(msg.metadata),
            origin=Origin(
                self.member, msg.channel, msg.chat_id, self.key, self.holder.token, entry_id
            ),
            services=self.rt.services,
        )
        if entry_id:
            ctx.turn_id = f"{self.member}|{entry_id}"
        row = user_row(msg, row_id)
        puller = self._puller(session, entry_id, row_id)
        on_delta = None
        if self.rt.config.stream_deltas:
            on_delta = lambda text: self._emit(msg, reply_to, text, kind="delta")  # noqa: E731
        if puller is not None and session.policy.persist:
            puller.defer()  # a durable session's commit does the turn's last read
        turn = self.rt.runner.run(session, row, memory, ctx, state, puller, on_delta, retry=retry)
        task = asyncio.create_task(turn)
        running = Running(task, msg, session, state, reply_to, ctx, puller, journal)
        return await self.settle(running)

    async def settle(self, turn: Running) -> Outcome:
        """The outcome of the turn's task; ``pending`` when it left what arrived at its last
        model boundary to the commit."""
        task, state, puller = turn.task, turn.state, turn.puller
        reason = await self._await_turn(task)
        mark = turn.session.mark()  # before the outcome adds the turn's rows
        outcome = await self._outcome(task, reason, turn.msg, turn.session, state,
                                      turn.reply_to, turn.ctx)  # fmt: skip
        answered = not task.cancelled() and task.exception() is None
        if state.rounds is not None and puller is not None and answered:
            outcome.pending = Pending(self, turn, mark, puller.after_id)
        outcome.tokens = (state.tokens_in, state.tokens_out)
        outcome.journal = turn.journal
        if puller is not None and puller.injected:
            outcome.injected = list(puller.injected)
            if outcome.reply is not None:
                covers = [turn.reply_to, *(r for _, r in puller.injected)]
                outcome.reply.covers = list(dict.fromkeys(covers))  # (an id sent again: once)
        return outcome

    def _puller(self, session: Session, entry_id: str, row_id: str) -> FollowUpPuller | None:
        cfg = self.rt.config
        if not entry_id or cfg.followup_mode != "inject":
            # joining costs a read of the stream at every model boundary: a queue
            # deployment does not pay it (a message cannot ask to join there)
            return None
        return FollowUpPuller(
            self.rt.bus,
            session,
            self.member,
            entry_id,
            max_bytes=cfg.max_payload_bytes,
            per_pull=cfg.followups_per_pull,
            scope_of=lambda m: self.rt.scope_for(m.channel, m.scope, m.sender_id),
            folded=self.member != self.key,
            stopping=lambda: self.rt.turns.stopping,
            default_mode=cfg.followup_mode,
            seen={row_id},
        )

    async def _await_turn(self, task: asyncio.Task[str]) -> str | None:
        """Wait for the turn; a control that came while the session was loading cancels
        it at once (``TurnRegistry.attach``). Returns the cancel reason, if any."""
        slot = self.holder.slot  # its own entry: a newer holder's may be K's current one
        assert slot is not None  # begun before the turn runs (SessionHolder, process_message)
        self.rt.turns.attach(slot, task)
        me = asyncio.current_task()
        before = me.cancelling() if me is not None else 0
        # the turn's own end (a result, its failure, a control's cancel) is read from the
        # task by the outcome; cancelling our own task cancels the turn, which it awaits
        try:  # noqa: SIM105 (suppress() costs three calls a turn)
            await task
        except BaseException:
            pass
        if me is not None and me.cancelling() > before:  # our own task is cancelled (the
            raise asyncio.CancelledError  # turn has ended: awaiting it forwarded the cancel)
        return slot.reason

    async def _outcome(
        self,
        task: asyncio.Task[str],
        reason: str | None,
        msg: InboundMessage,
        session: Session,
        state: TurnState,
        reply_to: str,
        ctx: ToolContext,
    ) -> Outcome:
        key, member = self.key, self.member
        if task.cancelled() or reason in ("lease_lost", "shutdown"):
            if reason in (None, "lease_lost", "shutdown"):
                raise TurnAbortedError(reason or "cancelled")
            keeps = reason in KEEPS_WORK
            kept = legal_prefix(state.rows) if keeps else []
            if keeps:  # its work up to the last complete tool exchange
                self._append(session, kept)
            if reason in (*KEEPS_WORK, "discard"):  # rows dropped: so are their schedules
                await _undo(
                    ctx,
                    sum(1 for r in kept if r.get("role") == "assistant" and r.get("tool_calls")),
                )
            detail = f"turn cancelled by {reason}"
            out = error(msg.channel, msg.chat_id, member, reply_to, "cancelled", detail)
            return Outcome(out, session if keeps else None)
        exc = task.exception()
        if isinstance(exc, ProviderError):
            # the user row and the complete tool exchanges: their effects (a schedule, a
            # subagent, a message sent) are in the history, and a Retry goes on from them
            self._append(session, legal_prefix(state.rows))
            if session.policy.log_content:
                log.warning("provider error in %s: %s", safe(key), safe(str(exc)))
            else:  # a private session's line names neither its chat nor its text
                cause = type(exc.__cause__ or exc).__name__
                log.warning("provider error in a private session: %s", cause)
            out = error(msg.channel, msg.chat_id, member, reply_to, "provider_error", str(exc))
            return Outcome(out, session)
        if exc is not None:
            raise exc
        return self._answered(msg, session, state, reply_to, task.result())

    def _answered(
        self,
        msg: InboundMessage,
        session: Session,
        state: TurnState,
        reply_to: str,
        answer: str | None,
    ) -> Outcome:
        key, member = self.key, self.member
        self._append(session, state.rows)
        if key == UNIFIED_SESSION_KEY:  # where the shared session last spoke, under the lease
            session.metadata["last_channel"] = f"{msg.channel}:{msg.chat_id}"
        meta = {**msg.metadata, "worker": self.rt.worker_id}
        answer = answer or ""
        if state.unknown:  # the user is told which effects a crash left unknown
            meta["resumed"] = {"unknown_effects": sorted(set(state.unknown))}
            answer += RESUMED_NOTE.format(tools=", ".join(sorted(set(state.unknown))))
        return Outcome(reply(msg, member, reply_to, answer, metadata=meta), session)

    def _append(self, session: Session, rows: list[dict[str, Any]]) -> None:
        """A turn's rows, whatever its end; a private session keeps its newest
        ``private_history_rows`` only, within ``private_history_chars`` (the worker's
        memory holds it: a frontend must not fill it, with answers, failures or huge
        messages)."""
        session.append_rows(rows)
        if not session.policy.persist:
            cfg = self.rt.config
            self.rt.sessions.trim_transient(
                self.key, cfg.private_history_rows, cfg.private_history_chars
            )

    async def _emit(
        self, msg: InboundMessage, reply_to: str, text: str, *, kind: str = "progress"
    ) -> None:
        """A fenced non-terminal event: ``progress`` (message tool) or ``delta``."""
        self._seq += 1
        meta: dict[str, object] = {"seq": self._seq}
        if kind == "progress":
            meta["tool"] = "message"
        out = OutboundMessage(
            type=kind,
            channel=msg.channel,
            chat_id=msg.chat_id,
            session_key=self.member,
            reply_to=reply_to,
            content=text,
            metadata=meta,
        )
        payload = out.model_dump_json(exclude_none=True)
        transient = self.holder.transient
        bus, token = self.rt.bus, self.holder.token
        try:
            written = await bus.emit(self.key, token, self.member, payload, transient=transient)
        except OutOfMemoryError:
            if kind != "delta":
                raise  # (the message tool answers the model with the failure)
            return  # Redis is full: a piece of the answer is not shown live; the answer
            # itself comes whole with the terminal event (a failed turn would be counted)
        if not written:
            self.rt.turns.metrics["fenced_writes_rejected"] += 1
            self.rt.metrics.fenced_writes_rejected.inc()


async def _undo(ctx: ToolContext, kept_rounds: int) -> None:
    """Undo the outside effects of the calls of the rounds after the first ``kept_rounds``
    (what a cut turn keeps is whole rounds: ``legal_prefix``), the newest first: an add
    then a remove of one schedule is undone as a re-add then a remove, and a remove then
    an add at the session's limit frees the slot before the first comes back."""
    for round_, undo in reversed(ctx.undo):
        if round_ <= kept_rounds:
            continue
        try:
            await undo()
        except Exception as exc:  # one failed undo must not keep the others from running
            log.warning("undoing an effect of a cut turn failed: %s", type(exc).__name__)
