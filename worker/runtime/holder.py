"""SessionHolder: what a worker does while it holds one effective key's lease.

drain():  step = acquire's first entry (what one entry becomes: ``EntryPolicy``, entry.py)
          loop: Entry -> handle() -> fenced commit (+ select next / release)
                ControlReached (discard / new / delete marker) -> forget (fold, delete) the
                  session, next() (which consumes a new or delete marker kept at the head);
                  unified mode, a private session's own lease: release (re-notified)
                More  -> next() over the grown stream set
                Released / Lost -> done
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable

from redis.exceptions import OutOfMemoryError, RedisError

from bus_redis.codec import safe, stream_id_ms
from bus_redis.results import (
    Acquired,
    Again,
    CommitSpec,
    ControlReached,
    Entry,
    Late,
    Lost,
    More,
    Released,
    Step,
)
from session_store import UNIFIED_SESSION_KEY
from worker.runtime.backoff import while_full
from worker.runtime.context import Runtime
from worker.runtime.entry import EntryPolicy
from worker.runtime.faults import crash_point
from worker.runtime.forgetting import forget
from worker.runtime.inflight import Slot
from worker.runtime.lease import Lease
from worker.runtime.outcomes import (
    TurnAbortedError,
)
from worker.runtime.pending import Pending

log = logging.getLogger(__name__)


class SessionHolder(EntryPolicy):
    def __init__(
        self, rt: Runtime, key: str, acquired: Acquired, members: set[str], memory_scope: str = ""
    ) -> None:
        self.rt = rt
        self.key = key
        self.token = acquired.token
        self.version = acquired.version
        self.generation = acquired.generation
        self.ahead = acquired.ahead  # the rows the cached session lacked (its first turn's)
        self.memory_version = acquired.memory_version
        self.memory_scope = memory_scope  # the scope whose memory version acquire read
        self.first: Step | None = acquired.step
        self.members = members
        self.pending: Pending | None = None  # the running turn waits for its commit's verdict
        self.slot: Slot | None = None  # the entry being handled as the running turn of K
        self.lease = Lease(rt.bus, key, acquired.token, on_lost=self._lease_lost)
        self.aborted = False

    def holds(self) -> bool:
        return self.lease.holds()

    def _lease_lost(self) -> None:
        self.rt.turns.metrics["leases_lost"] += 1
        self.rt.metrics.leases_lost.inc()
        self.abort("lease_lost")

    def abort(self, reason: str) -> None:
        """Cancel this holder's entry, never a newer holder's of the same key: one whose
        lease was taken over may still be finishing when this worker takes K again. A
        write it waits to make while Redis is full is given up (``waits``)."""
        self.aborted = True
        if self.slot is not None:
            self.rt.turns.cancel_slot(self.slot, reason)

    def waits(self) -> bool:
        """Whether a write Redis refused for memory is tried again: while the lease
        holds and the holder is not aborted (a shutdown past its grace period)."""
        return not self.aborted and self.holds()

    # --- the lease-holding loop ----------------------------------------------------------
    async def drain(self) -> None:
        self.lease.start()
        try:
            step, self.first = self.first, None  # (its payload is not kept past its turn)
            while not self.lease.lost:
                if isinstance(step, Entry):
                    self.members.add(step.member)
                    step = await self._process(step)
                elif isinstance(step, ControlReached):
                    self.members.add(step.member)  # (its stream: where next() consumes it)
                    if step.attempts > self.rt.config.max_deliveries:
                        log.error(
                            "a %s of %s was reached %d times without taking effect: dropped",
                            step.op, safe(step.member), step.attempts,
                        )  # fmt: skip
                    else:
                        await self.discarded(step.member, step.op, step.marker)
                    if self._folds_again(step.member):
                        # the private session this lease served ended: what S holds next
                        # is durable, the unified session's to answer (re-notified)
                        await self.rt.bus.release(self.key, self.token, done=step)
                        break
                    step = await self._next(step)
                elif isinstance(step, Again):  # bounded work per call: other clients between
                    if self.rt.turns.stopping:  # shutting down: hand the rest over
                        await self.rt.bus.release(self.key, self.token)
                        break
                    step = await self._next()
                elif isinstance(step, More):
                    # the pending set is the truth: streams emptied, or left alone (private
                    # now, or served by a holder of their own) are no longer ours
                    self.members = set(step.members)
                    step = await self._next()
                else:
                    if isinstance(step, Lost):
                        log.warning("lease of %s was lost", safe(self.key))
                    break
        except Exception as exc:
            # a failure no step handled: the lease is given up now (fenced writes keep what
            # it did safe), so that the session's next holder need not wait out its term;
            # but after a write whose outcome is unknown (a connection lost, a timeout),
            # which the term lets settle
            unknown = isinstance(exc, RedisError | OSError) and not isinstance(
                exc, OutOfMemoryError
            )
            if not self.lease.lost and not unknown:
                with contextlib.suppress(RedisError, OSError):
                    await self.rt.bus.release(self.key, self.token)
            raise
        finally:
            await self._stop()

    async def _stop(self) -> None:
        for member in self.members:  # (what a control ended at a marker not reached)
            self.rt.turns.take_ended(member)
        await self.lease.stop()

    def _folds_again(self, member: str) -> bool:
        """Unified mode: a stream held under its own key (a private session) whose session
        was just forgotten is folded under the unified key again."""
        rt = self.rt
        return (
            rt.config.unified_session
            and member == self.key != UNIFIED_SESSION_KEY
            and not rt.sessions.is_transient(member)
        )

    async def _next(self, done: ControlReached | None = None) -> Step:
        return await self.rt.bus.next(self.key, self.token, sorted(self.members), done=done)

    async def discarded(self, member: str, op: str = "discard", marker: str = "") -> None:
        """A discard, new or delete reached stream ``member`` (``forgetting.forget``)."""
        await forget(self, member, op, marker)

    async def _process(self, entry: Entry) -> Step:
        metrics, started = self.rt.metrics, time.monotonic()
        if entry.attempts > 1:
            metrics.redeliveries.inc()
        waited_ms = time.time() * 1000 - stream_id_ms(entry.entry_id)
        metrics.queue_wait_seconds.observe(max(0.0, waited_ms) / 1000)
        metrics.handling += 1
        try:
            return await self._process_entry(entry, started)
        finally:
            metrics.handling -= 1

    def _done(self, entry: Entry, spec: CommitSpec, started: float) -> None:
        """A committed entry: its metrics and its one log line (a private session's
        line carries sizes only)."""
        metrics, elapsed = self.rt.metrics, time.monotonic() - started
        outcome = spec.outcome or "none"
        metrics.turn(outcome, elapsed)
        if spec.dead:
            metrics.dead_letter(spec.dead_reason)
        if not log.isEnabledFor(logging.INFO):
            return
        tokens_in, tokens_out = spec.tokens
        private = spec.transient or self.rt.sessions.is_transient(entry.member)
        if private or (spec.dead and self._private(entry)):
            log.info(
                "turn of a private session: %d bytes in, %d bytes out, outcome %s, %d ms, "
                "tokens %d+%d",
                len(entry.payload), len(spec.reply), outcome, elapsed * 1000, tokens_in,
                tokens_out,
            )  # fmt: skip
        else:
            log.info(
                "turn of %s message %s (entry %s): outcome %s, %d ms, tokens %d+%d, attempt %d",
                safe(entry.member), safe(spec.message_id or "-"), entry.entry_id, outcome,
                elapsed * 1000, tokens_in, tokens_out, entry.attempts,
            )  # fmt: skip

    async def _process_entry(self, entry: Entry, started: float) -> Step:
        if self.rt.turns.stopping:  # shutting down: take no further entry, hand it over
            await self.rt.bus.release(self.key, self.token)
            return Released()
        self.pending = None
        try:
            return await self._entry_turns(entry, started)
        finally:
            self.pending = None
            self._unregister()

    async def _entry_turns(self, entry: Entry, started: float) -> Step:
        spec = await self._running(entry, self.handle(entry))
        while True:
            if isinstance(spec, Released):
                return spec
            if spec is None:  # the turn failed: try the entry again (counts a delivery)
                self._unregister()
                return await self._next()
            crash_point("before_commit")
            if self.rt.turns.stopping:  # shutting down: finish this entry, leave the rest
                self._unregister()
                return await self._last_commit(entry, spec, started)
            pending, self.pending = self.pending, None
            spec.late_after = pending.late_after if pending is not None else ""
            step, committed = await self._commit_entry(entry, spec)
            if not isinstance(step, Late):
                self._unregister()
                if not committed:  # tried again
                    return step or Released()
                break
            # refused, nothing written: a message arrived that may join the turn, which
            # reads its stream and goes on (or ends as it was): a new spec. It stayed the
            # running turn meanwhile: a control that came is applied as it goes on.
            assert pending is not None
            fresh = CommitSpec(entry.member, [entry.entry_id], transient=spec.transient)
            fresh.message_id = spec.message_id
            spec = await self._running(entry, self._outcome_spec(entry, fresh, pending.go_on()))
        crash_point("after_commit")
        if not isinstance(step, Lost):
            self._done(entry, spec, started)
        return step or Released()

    async def _last_commit(self, entry: Entry, spec: CommitSpec, started: float) -> Step:
        """At shutdown: commit this entry (what arrived meanwhile gets its own turn
        elsewhere) and release the lease."""
        self.pending = None
        what = f"last commit of {safe(self.key)}"  # (a full Redis: until the grace ends)
        version, _ = await self.commit_full(what, spec, select=None)
        if version >= 0:
            self._done(entry, spec, started)
        if not self.lease.lost:
            await self.rt.bus.release(self.key, self.token)
        return Released()

    async def _commit_entry(
        self, entry: Entry, spec: CommitSpec
    ) -> tuple[Step | Late | None, bool]:
        """The fenced commit and the next step; ``(next step, False)`` when it failed and
        the entry is tried again; ``Late`` when refused (``spec.late_after``)."""
        what = f"commit of a turn of {safe(self.key)}"
        try:  # (refused for memory: nothing written, tried again while the lease holds)
            _, step = await self.commit_full(what, spec, select=sorted(self.members))
        except (RedisError, OSError):
            raise  # outcome unknown: the lease is given up and the entry is served again
        except Exception as exc:  # e.g. a value Redis cannot take: again, then dead letter
            log.exception("commit of an entry of %s failed", safe(self.key))
            await self.rt.registry.note_failure(entry.member, entry.entry_id, type(exc).__name__)
            return await self._next(), False
        return step, True

    async def commit_full(
        self, what: str, spec: CommitSpec, *, select: list[str] | None
    ) -> tuple[int, Step | Late | None]:
        """:meth:`commit`, tried again while Redis refuses it for memory and the holder
        waits. An opening counts as opening (its owner record not missing) until its
        commit landed or was given up: then the record is written, or never will be by it."""
        try:
            return await while_full(what, log, self.waits, lambda: self.commit(spec, select=select))
        finally:
            if spec.owner_op == "set":
                self.rt.turns.opened(spec.member)

    async def _running(
        self, entry: Entry, work: Awaitable[CommitSpec | None]
    ) -> CommitSpec | Released | None:
        """``work`` (a turn, or its going on) as the running turn of ``entry``: controls
        reach it. An outcome that waits for its commit's verdict (``self.pending``) stays
        the running turn until then. Released: it was aborted (shutdown, lease lost)."""
        turns = self.rt.turns
        if self.slot is None:
            self.slot = turns.begin(self.key, entry.member, entry.entry_id)
            if turns.take_recent(entry.member, self.key):  # a control raced the selection
                self.rt.look(self.key)
        try:
            return await work
        except TurnAbortedError:
            self._unregister()
            if not self.lease.lost:  # shutdown: give the lease up now, re-notify the rest
                await self.rt.bus.release(self.key, self.token)
            return Released()
        finally:
            if self.pending is None:
                self._unregister()

    def _unregister(self) -> None:
        slot, self.slot = self.slot, None
        if slot is not None:  # ours only: a newer holder of K may have begun meanwhile
            self.rt.turns.end(self.key, slot)

    async def commit(
        self, spec: CommitSpec, *, select: list[str] | None
    ) -> tuple[int, Step | Late | None]:
        """One fenced commit (callers go through :meth:`commit_full`)."""
        rt = self.rt
        if spec.transient and spec.reply and spec.owner_op != "set" and not self.lease.lost:
            # delivered (XDEL'd) private events leave no bytes behind: a fresh stream
            await rt.bus.compact_private(self.key, self.token, spec.member)
        try:
            version, gen, step = await rt.bus.commit(
                self.key, self.token, rt.worker_id, spec, select=select
            )
        except BaseException:
            # Unknown whether it landed: the next turn reloads the session from Redis.
            rt.sessions.invalidate_stored(self.key)
            raise
        if isinstance(step, Late):  # nothing written: the turn goes on
            return version, step
        if version < 0:
            rt.turns.metrics["fenced_writes_rejected"] += 1
            rt.metrics.fenced_writes_rejected.inc()
            rt.sessions.invalidate_stored(self.key)
            log.warning("fenced commit of %s rejected: lease lost", safe(self.key))
            self.lease.lost = True
            return version, Lost()
        if isinstance(step, Released):  # no longer ours: a renewal answered now is stale
            await self.lease.stop()
        if spec.meta:
            self.version, self.generation = version, gen
            cached = rt.sessions.get_cached(self.key)
            if cached is not None:
                cached.mark_persisted(version, gen)
                try:  # (committed: a failure here must not make it be committed again)
                    await rt.maybe_consolidate(cached)
                except (RedisError, OSError) as exc:  # the next commit asks again
                    log.warning("queueing a consolidation failed: %s", type(exc).__name__)
        return version, step
