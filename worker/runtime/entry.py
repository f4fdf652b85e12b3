"""What one entry becomes, for the holder of its session's lease (``SessionHolder``): a
rejection, a dead letter, a cancellation, an opened private session, or a turn
(``TurnExecution``), filled into the ``CommitSpec`` the holder commits."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable

from redis.exceptions import RedisError

from bus_redis import (
    InboundMessage,
    MessageRejectedError,
    OpenTransient,
    OutboundMessage,
    decode_inbound,
)
from bus_redis.codec import safe
from bus_redis.keys import channel_of
from bus_redis.results import CommitSpec, Entry, owner_member
from session_store.codec import encode_meta, encode_rows
from worker.agent.tools.base import Origin
from worker.runtime.backoff import while_full
from worker.runtime.controls import FORGETTING
from worker.runtime.execution import Held, Outcome, TurnExecution
from worker.runtime.journal import undo_journaled
from worker.runtime.outcomes import (
    ScopeMismatchError,
    SessionNotActiveError,
    TurnAbortedError,
    dead_letter,
    error,
    looks_private,
    rejection,
)
from worker.runtime.pending import Pending

log = logging.getLogger(__name__)


class EntryPolicy(Held):
    """The per-entry half of ``SessionHolder``, which sets the lease view's attributes
    (``Held``) and ``pending``."""

    pending: Pending | None  # the turn waits for its commit's verdict

    def waits(self) -> bool:
        """Whether a write refused for memory is tried again (``SessionHolder``)."""
        return self.holds()

    @property
    def transient(self) -> bool:
        return self.rt.sessions.is_transient(self.key)

    async def discarded(self, member: str, op: str = "discard", marker: str = "") -> None:
        """Forget (or delete) the session of stream ``member`` (the holder's)."""
        raise NotImplementedError

    # --- one entry -------------------------------------------------------------------------
    def _private(self, entry: Entry) -> bool:
        sessions = self.rt.sessions
        return self.transient or sessions.is_transient(entry.member) or looks_private(entry.payload)

    async def _undo_lost_attempts(self, entry: Entry, msg: InboundMessage | OpenTransient) -> None:
        """The entry's turn ends without running again: what its lost attempts did outside
        their uncommitted rows (their journal) is undone (``undo_journaled``)."""
        if entry.attempts <= 1 or self._private(entry):
            return  # (no attempt before this one; a private session keeps no journal)
        origin = Origin(
            msg.session_key, msg.channel, msg.chat_id, self.key, self.token, entry.entry_id
        )
        try:
            await undo_journaled(self.rt.bus, self.rt.services, origin)
        except (RedisError, OSError) as exc:  # (its effects stay: as before)
            log.warning("the effects of a lost turn of %s were not undone: %s",
                        safe(entry.member), type(exc).__name__)  # fmt: skip

    async def handle(self, entry: Entry) -> CommitSpec | None:
        """What one entry becomes: a rejection, a dead letter, a cancellation, an opened
        private session or a turn. ``None``: the turn failed and the entry is retried."""
        rt = self.rt
        spec = CommitSpec(member=entry.member, entry_ids=[entry.entry_id], transient=self.transient)
        try:
            payload = decode_inbound(entry.payload, max_bytes=rt.config.max_payload_bytes)
            if payload.session_key != entry.member:
                raise MessageRejectedError(
                    "invalid_message",
                    "the payload names another session than the stream it was published on",
                    channel=payload.channel,
                    chat_id=payload.chat_id,
                    message_id=payload.id,
                )
        except MessageRejectedError as exc:
            log.warning("rejected entry %s of %s: %s", entry.entry_id, safe(entry.member), exc.code)
            self._set_reply(spec, rejection(exc, entry))
            reason = f"{exc.code}: {exc.detail}"
            spec.dead = dead_letter(entry, reason, rt.worker_id, private=self._private(entry))
            spec.dead_reason = exc.code
            return spec
        reply_to = payload.id or entry.entry_id
        spec.message_id = reply_to

        def fail(code: str, detail: str) -> CommitSpec:
            out = error(payload.channel, payload.chat_id, entry.member, reply_to, code, detail)
            self._set_reply(spec, out)
            return spec

        opening = isinstance(payload, OpenTransient)
        if entry.attempts > rt.config.max_deliveries:
            if opening:  # marked all the same, as far as Redis lets it: never held up by it
                with contextlib.suppress(RedisError, OSError):
                    await rt.bus.mark_private(entry.member)
            cause = await rt.registry.last_failure(entry.member, entry.entry_id)
            reason = f"failed {entry.attempts - 1} times; last error: {cause or 'unknown'}"
            await self._undo_lost_attempts(entry, payload)
            spec.dead = dead_letter(entry, reason, rt.worker_id, private=self._private(entry))
            spec.dead_reason = "failed"
            return fail("dead_lettered", f"gave up after {entry.attempts - 1} failed attempts")
        if opening:  # marked whatever becomes of the opening now (cancelled, refused)
            await while_full(  # (a full Redis is no failure of the opening)
                "marking a private session", log, self.waits,
                lambda: rt.bus.mark_private(entry.member),
            )  # fmt: skip
        if entry.covered_by:
            await self._undo_lost_attempts(entry, payload)
            if entry.covered_by in FORGETTING:
                await self.discarded(entry.member)  # a delete applies at its own marker
            return fail("cancelled", f"cancelled by {entry.covered_by}")
        if isinstance(payload, OpenTransient):
            return await self._open_transient(spec, payload, reply_to)
        return await self._turn(entry, payload, spec, reply_to, fail)

    async def _turn(
        self,
        entry: Entry,
        msg: InboundMessage,
        spec: CommitSpec,
        reply_to: str,
        fail: Callable[[str, str], CommitSpec],
    ) -> CommitSpec | None:
        run = self.run_message(
            msg, reply_to=reply_to, member=entry.member, entry_id=entry.entry_id,
            attempts=entry.attempts,
        )  # fmt: skip
        try:
            return await self._outcome_spec(entry, spec, run)
        except SessionNotActiveError as exc:
            return fail("session_not_active", str(exc))
        except ScopeMismatchError as exc:
            return fail("invalid_message", str(exc))

    async def _outcome_spec(
        self, entry: Entry, spec: CommitSpec, run: Awaitable[Outcome]
    ) -> CommitSpec | None:
        """``spec`` filled with the outcome of ``run``; None: the turn failed."""
        try:
            outcome = await run
        except (SessionNotActiveError, ScopeMismatchError, TurnAbortedError):
            raise
        except Exception as exc:
            if self._private(entry):  # no traceback: it may quote content
                log.error("turn of a private session failed (attempt %d)", entry.attempts)
            else:
                log.exception("turn of %s failed (attempt %d)", safe(self.key), entry.attempts)
            await self.rt.registry.note_failure(entry.member, entry.entry_id, type(exc).__name__)
            return None
        self.fill_spec(spec, outcome)
        self.pending = outcome.pending
        return spec

    @staticmethod
    def _set_reply(spec: CommitSpec, out: OutboundMessage | None) -> None:
        if out is not None:
            spec.reply = out.model_dump_json(exclude_none=True)
            spec.outcome = out.code or out.type

    def fill_spec(self, spec: CommitSpec, outcome: Outcome) -> None:
        self._set_reply(spec, outcome.reply)
        spec.journaled = outcome.journal is not None and outcome.journal.written
        spec.tokens = outcome.tokens
        spec.entry_ids.extend(eid for eid, _ in outcome.injected)
        session = outcome.session
        if session is not None and session.policy.persist:
            spec.meta = encode_meta(session)
            spec.rows = encode_rows(session.unpersisted())
            spec.scope = session.scope

    async def _open_transient(
        self, spec: CommitSpec, op: OpenTransient, reply_to: str
    ) -> CommitSpec:
        key = op.session_key
        rt = self.rt
        same_channel = [k for k in rt.turns.owned() if channel_of(k) == op.channel]
        if key not in same_channel and len(same_channel) >= rt.config.max_private_sessions:
            detail = f"this worker holds {len(same_channel)} private sessions of {op.channel}"
            out = error(op.channel, op.chat_id, key, reply_to, "limit_exceeded", detail)
            self._set_reply(spec, out)
            return spec
        live = self.rt.sessions.get_cached(key) if rt.turns.owns(key) else None
        wanted = None if op.scope is None else rt.scope_for(op.channel, op.scope, op.sender_id)
        if (
            live is not None
            and live.scope
            and rt.scope_for(op.channel, op.scope, op.sender_id) != live.scope
            and not rt.config.owner_mode
        ):  # a live private session is its scope's: another one's opening takes nothing of
            # it (one that names no scope asks for its sender's: it wiped the live one)
            detail = "this private session is open under another scope"
            self._set_reply(
                spec, error(op.channel, op.chat_id, key, reply_to, "invalid_message", detail)
            )
            return spec
        session = self.rt.sessions.get_or_create_transient(key, disabled_tools=op.disabled_tools)
        if wanted is not None:
            session.scope = wanted
        if not session.born:  # what the stored session on the key made (a schedule's
            session.born = spec.entry_ids[0]  # firing) is older: never runs in this one
        member = owner_member(key, op.channel, op.chat_id)
        self.rt.turns.own(key, member, opening=True)  # (counted at once: the bound above)
        await while_full(  # (per-session mode: its provisional end, before its record)
            "opening a private session", log, self.waits,
            lambda: rt.registry.opening_owner(key, member),
        )  # fmt: skip
        spec.owner_op, spec.owner_member, spec.transient = "set", member, True
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
        self,
        msg: InboundMessage,
        *,
        reply_to: str,
        member: str,
        entry_id: str = "",
        attempts: int = 1,
    ) -> Outcome:
        return await TurnExecution(self).run(
            msg, reply_to=reply_to, member=member, entry_id=entry_id, attempts=attempts
        )
