"""SessionHolder: what a worker does while it holds one session's lease.

drain():  step = acquire's first entry
          loop: Entry -> handle() -> fenced commit (+ select next / release)
                More  -> next() over the grown stream set
                Released / Lost -> done
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bus_redis import (
    SESSION_NOT_ACTIVE,
    InboundMessage,
    MessageRejectedError,
    OpenTransient,
    OutboundMessage,
    decode_inbound,
)
from bus_redis.streams import Acquired, CommitSpec, Entry, Lost, More, Released, Step, owner_member
from session_store import Session
from session_store.codec import encode_meta, encode_rows
from worker.faults import crash_point
from worker.followups import FollowUpPuller
from worker.lease import Lease
from worker.outcomes import (
    SessionNotActiveError,
    TurnAbortedError,
    cancelled_by_flag,
    dead_letter,
    error,
    legal_prefix,
    rejection,
    reply,
)
from worker.providers import ProviderError
from worker.tools import ToolContext
from worker.turn import TurnState, user_row

if TYPE_CHECKING:
    from worker.loop import AgentLoop

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Outcome:
    reply: OutboundMessage | None
    session: Session | None = None  # persist its unpersisted rows when durable
    injected: list[tuple[str, str]] = field(default_factory=list)  # (entry id, reply_to)


class SessionHolder:
    def __init__(self, loop: AgentLoop, key: str, acquired: Acquired, members: set[str]) -> None:
        self.loop = loop
        self.key = key
        self.token = acquired.token
        self.version = acquired.version
        self.memory_version = acquired.memory_version
        self.first: Step | None = acquired.step
        self.members = members
        self.lease = Lease(loop.bus, key, acquired.token, on_lost=lambda: self.abort("lease_lost"))
        self.rejected_writes = 0

    def abort(self, reason: str) -> None:
        for task in self.loop.active_tasks.get(self.key, ()):
            self.loop.cancel_reasons.setdefault(task, reason)
            task.cancel()

    # --- the lease-holding loop ----------------------------------------------------------
    async def drain(self) -> None:
        self.lease.start()
        try:
            step = self.first
            while not self.lease.lost:
                if isinstance(step, Entry):
                    self.members.add(step.member)
                    step = await self._process(step)
                elif isinstance(step, More):
                    self.members.update(step.members)
                    step = await self.loop.bus.next(self.key, self.token, sorted(self.members))
                else:
                    if isinstance(step, Lost):
                        log.warning("lease of %s was lost", self.key)
                    break
        finally:
            await self.lease.stop()
            self.loop.active_members.pop(self.key, None)

    async def _process(self, entry: Entry) -> Step:
        try:
            spec = await self.handle(entry)
        except TurnAbortedError:
            if not self.lease.lost:  # shutdown: give the lease up now, re-notify the rest
                await self.loop.bus.release(self.key, self.token)
            return Released()
        if spec is None:  # the turn failed: try the entry again (counts a delivery)
            return await self.loop.bus.next(self.key, self.token, sorted(self.members))
        crash_point("before_commit")
        _, step = await self.commit(spec, select=sorted(self.members))
        crash_point("after_commit")
        return step or Released()

    async def commit(
        self, spec: CommitSpec, *, select: list[str] | None
    ) -> tuple[int, Step | None]:
        try:
            version, step = await self.loop.bus.commit(
                self.key, self.token, self.loop.worker_id, spec, select=select
            )
        except BaseException:
            # Unknown whether it landed: the next turn reloads the session from Redis.
            if not self.loop.sessions.is_transient(self.key):
                self.loop.sessions.invalidate(self.key)
            raise
        if version < 0:
            self.rejected_writes += 1
            if not self.loop.sessions.is_transient(self.key):
                self.loop.sessions.invalidate(self.key)
            log.warning("fenced commit of %s rejected: lease lost", self.key)
            self.lease.lost = True
            return version, Lost()
        if spec.meta:
            self.version = version
            cached = self.loop.sessions.get_cached(self.key)
            if cached is not None:
                cached.mark_persisted(version)
                await self.loop.consolidator.maybe_consolidate_by_tokens(cached)
        return version, step

    # --- one entry -------------------------------------------------------------------------
    async def handle(self, entry: Entry) -> CommitSpec | None:
        spec = CommitSpec(member=entry.member, entry_ids=[entry.entry_id])
        cfg = self.loop.config
        try:
            payload = decode_inbound(entry.payload, max_bytes=cfg.max_payload_bytes)
        except MessageRejectedError as exc:
            log.warning("rejected entry %s of %s: %s", entry.entry_id, entry.member, exc.code)
            bad = rejection(exc, entry)
            spec.reply, spec.reply_channel = (
                (bad.model_dump_json(exclude_none=True), bad.channel) if bad else ("", "")
            )
            spec.dead = dead_letter(entry, f"{exc.code}: {exc.detail}", self.loop.worker_id)
            return spec
        reply_to = payload.id or entry.entry_id
        if entry.attempts > cfg.max_deliveries:
            self._set_reply(
                spec,
                error(
                    payload.channel,
                    payload.chat_id,
                    self.key,
                    reply_to,
                    "dead_lettered",
                    f"gave up after {entry.attempts - 1} failed attempts",
                ),
            )
            spec.dead = dead_letter(entry, "max deliveries exceeded", self.loop.worker_id)
            return spec
        op = cancelled_by_flag(entry)
        if op is not None:
            if op == "discard":
                self.loop.forget(self.key)
            self._set_reply(
                spec,
                error(
                    payload.channel,
                    payload.chat_id,
                    self.key,
                    reply_to,
                    "cancelled",
                    f"cancelled by {op}",
                ),
            )
            return spec
        if isinstance(payload, OpenTransient):
            return self._open_transient(spec, payload, reply_to)
        try:
            outcome = await self.run_message(
                payload, reply_to=reply_to, member=entry.member, entry_id=entry.entry_id
            )
        except SessionNotActiveError as exc:
            self._set_reply(
                spec,
                error(
                    payload.channel,
                    payload.chat_id,
                    self.key,
                    reply_to,
                    "session_not_active",
                    str(exc),
                ),
            )
            return spec
        except TurnAbortedError:
            raise
        except Exception:
            log.exception("turn of %s failed (attempt %d)", self.key, entry.attempts)
            return None
        self.fill_spec(spec, outcome)
        return spec

    def _set_reply(self, spec: CommitSpec, out: OutboundMessage | None) -> None:
        if out is not None:
            spec.reply = out.model_dump_json(exclude_none=True)
            spec.reply_channel = out.channel

    def fill_spec(self, spec: CommitSpec, outcome: Outcome) -> None:
        self._set_reply(spec, outcome.reply)
        spec.entry_ids.extend(eid for eid, _ in outcome.injected)
        session = outcome.session
        if session is not None and session.policy.persist:
            spec.meta = encode_meta(session)
            spec.rows = encode_rows(session.unpersisted())

    def _open_transient(self, spec: CommitSpec, op: OpenTransient, reply_to: str) -> CommitSpec:
        key = op.session_key
        self.loop.sessions.get_or_create_transient(key, disabled_tools=op.disabled_tools)
        member = owner_member(key, op.channel, op.chat_id)
        self.loop.owned[key] = member
        self.loop.since_ms[key] = int(time.time() * 1000)
        spec.owner_op, spec.owner_member = "set", member
        out = OutboundMessage(
            type="message",
            channel=op.channel,
            chat_id=op.chat_id,
            session_key=key,
            reply_to=reply_to,
            metadata={"event": "transient_opened"},
        )
        self._set_reply(spec, out)
        return spec

    # --- the turn -------------------------------------------------------------------------------
    async def _session(self, msg: InboundMessage) -> Session:
        sessions = self.loop.sessions
        cached = sessions.get_cached(self.key)
        if msg.require_existing_session and cached is None:
            raise SessionNotActiveError(SESSION_NOT_ACTIVE)
        if cached is not None and sessions.is_transient(self.key):
            return cached
        return await sessions.load_for_turn(self.key, self.version)

    async def run_message(
        self, msg: InboundMessage, *, reply_to: str, member: str, entry_id: str = ""
    ) -> Outcome:
        session = await self._session(msg)
        if msg.id and session.has_seen(msg.id):
            log.info("duplicate message %s in %s skipped", msg.id, self.key)
            return Outcome(reply=None)
        memory = None
        if session.policy.persist:
            memory = await self.loop.memory.read_cached(self.memory_version)
        state = TurnState()
        ctx = ToolContext(
            session, self.loop.sessions, emit=lambda text: self._emit(msg, reply_to, text)
        )
        row = user_row(msg, reply_to)
        puller = self._puller(session, member, entry_id)
        task = asyncio.create_task(self.loop.runner.run(session, row, memory, ctx, state, puller))
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
            log.warning("provider error in %s: %s", key, exc)
            return Outcome(
                error(msg.channel, msg.chat_id, key, reply_to, "provider_error", str(exc)), session
            )
        if exc is not None:
            raise exc
        session.append_rows(state.rows)
        out = reply(msg, key, reply_to, task.result(), metadata={"worker": self.loop.worker_id})
        return Outcome(out, session)

    async def _emit(self, msg: InboundMessage, reply_to: str, text: str) -> None:
        out = OutboundMessage(
            type="progress",
            channel=msg.channel,
            chat_id=msg.chat_id,
            session_key=self.key,
            reply_to=reply_to,
            content=text,
            metadata={"tool": "message"},
        )
        if not await self.loop.bus.emit(
            self.key, self.token, msg.channel, out.model_dump_json(exclude_none=True)
        ):
            self.rejected_writes += 1

    def describe(self) -> dict[str, Any]:
        return {"key": self.key, "token": self.token, "members": sorted(self.members)}
