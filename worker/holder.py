"""SessionHolder: what a worker does while it holds one session's lease.

drain():  step = acquire's first entry
          loop: Entry -> handle() -> fenced commit (+ select next / release)
                More  -> next() over the grown stream set
                Released / Lost -> done
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from bus_redis import (
    InboundMessage,
    MessageRejectedError,
    OpenTransient,
    OutboundMessage,
    decode_inbound,
)
from bus_redis.results import Acquired, CommitSpec, Entry, Lost, More, Released, Step, owner_member
from session_store.codec import encode_meta, encode_rows
from worker.execution import Outcome, TurnExecution
from worker.faults import crash_point
from worker.lease import Lease
from worker.outcomes import (
    SessionNotActiveError,
    TurnAbortedError,
    cancelled_by_flag,
    dead_letter,
    error,
    rejection,
)

if TYPE_CHECKING:
    from worker.loop import AgentLoop

log = logging.getLogger(__name__)


class SessionHolder:
    def __init__(self, loop: AgentLoop, key: str, acquired: Acquired, members: set[str]) -> None:
        self.loop = loop
        self.key = key
        self.token = acquired.token
        self.version = acquired.version
        self.memory_version = acquired.memory_version
        self.first: Step | None = acquired.step
        self.members = members
        self.lease = Lease(loop.bus, key, acquired.token, on_lost=self._lease_lost)

    def _lease_lost(self) -> None:
        self.loop.metrics["leases_lost"] += 1
        self.abort("lease_lost")

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
        if self.loop.stopping:  # shutting down: finish this entry, leave the rest to others
            await self.commit(spec, select=None)
            if not self.lease.lost:
                await self.loop.bus.release(self.key, self.token)
            return Released()
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
            self.loop.metrics["fenced_writes_rejected"] += 1
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
        """What one entry becomes: a rejection, a dead letter, a cancellation, an opened
        private session or a turn. ``None``: the turn failed and the entry is retried."""
        spec = CommitSpec(member=entry.member, entry_ids=[entry.entry_id])
        cfg = self.loop.config
        try:
            payload = decode_inbound(entry.payload, max_bytes=cfg.max_payload_bytes)
        except MessageRejectedError as exc:
            log.warning("rejected entry %s of %s: %s", entry.entry_id, entry.member, exc.code)
            self._set_reply(spec, rejection(exc, entry))
            spec.dead = dead_letter(entry, f"{exc.code}: {exc.detail}", self.loop.worker_id)
            return spec
        reply_to = payload.id or entry.entry_id

        def fail(code: str, detail: str) -> CommitSpec:
            out = error(payload.channel, payload.chat_id, self.key, reply_to, code, detail)
            self._set_reply(spec, out)
            return spec

        if entry.attempts > cfg.max_deliveries:
            spec.dead = dead_letter(entry, "max deliveries exceeded", self.loop.worker_id)
            return fail("dead_lettered", f"gave up after {entry.attempts - 1} failed attempts")
        op = cancelled_by_flag(entry)
        if op is not None:
            if op == "discard":
                self.loop.forget(self.key)
            return fail("cancelled", f"cancelled by {op}")
        if isinstance(payload, OpenTransient):
            return self._open_transient(spec, payload, reply_to)
        try:
            outcome = await self.run_message(
                payload, reply_to=reply_to, member=entry.member, entry_id=entry.entry_id
            )
        except SessionNotActiveError as exc:
            return fail("session_not_active", str(exc))
        except TurnAbortedError:
            raise
        except Exception:
            if self.loop.sessions.is_transient(self.key):  # no traceback: it may quote content
                log.error("turn of a transient session failed (attempt %d)", entry.attempts)
            else:
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
    async def run_message(
        self, msg: InboundMessage, *, reply_to: str, member: str, entry_id: str = ""
    ) -> Outcome:
        return await TurnExecution(self).run(
            msg, reply_to=reply_to, member=member, entry_id=entry_id
        )
