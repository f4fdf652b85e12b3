"""Token-based consolidation: fold old messages of a durable session into its scope's
long-term memory, which stays within a budget.

Runs in the background, deduplicated per session, never for transient sessions. As
nanobot does, the model gets the scope's current memory and the old rows and returns the
updated memory (at most ``AGENT_MEMORY_MAX_CHARS``; longer is cut, keeping the newest
lines) and one line for the scope's dated history archive. The fold is made without the
lease (the LLM call may be slow); then, under the lease, ``consolidate.lua`` replaces the
memory, archives the entry and moves ``last_consolidated`` in one fenced step, provided
the memory is still the version the fold started from: when another consolidation of the
scope wrote first, the fold is made again from the memory that now is (so neither loses
the other's facts), at most ``FOLD_ATTEMPTS`` times.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from collections.abc import Iterable

from redis.exceptions import RedisError

from bus_redis.codec import safe
from bus_redis.keys import channel_of
from bus_redis.running_jobs import RUNNING_TTL_MS, RunningJobs
from session_store import Session
from session_store.codec import encode_meta
from worker.jobs.folds import FOLD_ATTEMPTS, MIN_PART_TOKENS, Fold, fold, part_of
from worker.runtime.acquiring import Acquirer
from worker.runtime.context import Runtime

log = logging.getLogger(__name__)
KEEP_RECENT = 8
MAX_PARTS = 8  # folds (model calls) of one job at most
JOB_NAME = "consolidate"
AGAIN_AFTER_S = 30.0  # a job put off for its channel's bound runs again this much later,
AGAIN_MAX_S = 3600.0  # twice as late each time it is put off again, an hour at most


class _ScopeBusyError(Exception):
    """Another job of this worker folds into the same scope's memory now."""


class Consolidator:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        # the jobs running here, for a survivor should this worker die
        self.running = RunningJobs(rt.bus, rt.worker_id, ttl_ms=RUNNING_TTL_MS)
        self._busy: collections.Counter[str] = collections.Counter()  # channel -> running
        self._folding: set[str] = set()  # scopes (and quota owners) a job here folds for now

    def _job_id(self, key: str) -> str:
        return f"{self.rt.bus.keys.prefix}:{JOB_NAME}:{key}"

    async def maybe_consolidate_by_tokens(self, session: Session) -> bool:
        """Queue a consolidation job when the unconsolidated history is over budget
        (at most one per session at a time; never for transient sessions)."""
        if not session.policy.persist or not session.scope:
            return False
        if session.token_count <= self.rt.config.consolidate_above_tokens:
            return False
        end = len(session.messages) - KEEP_RECENT
        if end <= session.last_consolidated:
            return False
        return await self.rt.jobs.enqueue(  # rows counted from the hash's first (absolute)
            JOB_NAME,
            job_id=self._job_id(session.key),
            key=session.key,
            start=session.base + session.last_consolidated,
            end=session.base + end,
        )

    async def run_job(self, *, key: str, start: int, end: int, tries: int = 0) -> None:
        """The job: fold rows ``start:end`` of a stored session (counted from the hash's
        first row) into its scope's memory. While it runs, this worker's entry names it
        (a survivor runs it again at once should this worker die: ``rerun_orphans``)."""
        channel = channel_of(key)
        if self._busy[channel] >= self.rt.config.consolidations_per_channel:
            # the channel's share of this worker's job slots is taken: queued again for
            # later (a slot is never held waiting), each time twice as late
            log.info("consolidation of %s put off: its channel's are running", safe(key))
            await self._again(key, start, end, tries + 1)
            return
        self._busy[channel] += 1
        try:
            put_off = await self._run_named(key, start, end, tries)
            if put_off is not None:  # its scope folds here now: again later
                await self._again(key, put_off, end, tries + 1)
        finally:
            self._busy[channel] -= 1
            if not self._busy[channel]:
                del self._busy[channel]

    async def _run_named(self, key: str, start: int, end: int, tries: int) -> int | None:
        job_id = self._job_id(key) + ("" if tries % 2 == 0 else ":again")  # (its own id)
        kwargs = {"key": key, "start": start, "end": end, "tries": tries}
        with contextlib.suppress(RedisError):  # (a job not named runs all the same)
            await self.running.started(job_id, JOB_NAME, channel_of(key), kwargs)
        try:
            return await self._run(key, start, end, stretch=tries > 0)
        finally:
            with contextlib.suppress(RedisError):  # (it lives RUNNING_TTL_MS at most)
                await self.running.ended(job_id)

    async def _again(self, key: str, start: int, end: int, tries: int) -> None:
        """Queue the job again ``AGAIN_AFTER_S * 2**(tries - 1)`` seconds from now (an
        hour at most), under the other id of the session's pair: its own is this job's
        while it runs. A session's next commit may queue it meanwhile (the job that comes
        second finds the rows consolidated), and may find the id taken by this one, whose
        range then ends before the rows it asked for: so a job queued again folds up to
        where the session's consolidation would end when it runs (``stretch``)."""
        delay_s = min(AGAIN_AFTER_S * 2 ** min(tries - 1, 16), AGAIN_MAX_S)
        job_id = self._job_id(key) + ("" if tries % 2 == 0 else ":again")
        with contextlib.suppress(RedisError, OSError):  # (its next commit asks again)
            await self.rt.jobs.enqueue(
                JOB_NAME, job_id=job_id, defer_until_ms=int((time.time() + delay_s) * 1000),
                key=key, start=start, end=end, tries=tries,
            )  # fmt: skip

    async def rerun_orphans(self, dead: str, channels: Iterable[str]) -> int:
        """The consolidations worker ``dead`` ran (judged dead) for sessions of
        ``channels`` run again now, not once the job queue's timeout ran out."""
        claimed = await self.running.claim(dead, channels, name=JOB_NAME)
        for at, (job_id, name, kwargs) in enumerate(claimed):
            try:
                await self.rt.jobs.orphaned(name, job_id=job_id, **kwargs)
            except Exception:  # the rest back in the dead worker's hash: claimed again later
                for back_id, _, back in claimed[at:]:
                    with contextlib.suppress(RedisError):
                        await self.running.give_back(
                            dead, back_id, JOB_NAME, channel_of(str(back.get("key"))), back
                        )
                raise
        return len(claimed)

    async def _run(self, key: str, start: int, end: int, *, stretch: bool = False) -> int | None:
        """Rows ``start:end`` folded part by part (``part_of``: about the consolidation
        threshold each, so that no request outgrows the model's context however far
        behind the folds fell), at most ``MAX_PARTS`` a job: a backlog left over is
        taken up by the job the next turn queues. Returns where a fold was put off
        because another job of its scope folds here now (None: done). ``stretch``: up to
        where the session's consolidation ends now (``KEEP_RECENT`` rows kept), if later."""
        for _ in range(MAX_PARTS):
            try:
                reached = await self._fold_part(key, start, end, stretch)
            except _ScopeBusyError:
                return start
            if reached is None:
                return None
            start, end = reached
            if start >= end:
                return None
        return None

    async def _fold_part(
        self, key: str, start: int, end: int, stretch: bool
    ) -> tuple[int, int] | None:
        """Fold the first part of rows ``start:end`` not consolidated yet (a part of this
        job that ran before, maybe on a worker that died, stays done): where the
        consolidated rows end now and the job's end (stretched, ``_run``), or None when
        there is nothing (more) to do here."""
        for _ in range(FOLD_ATTEMPTS):
            snapshot = await self.rt.sessions.store.load_recent(key)
            if snapshot is None or not snapshot.scope:
                return None  # gone, or transient (never stored)
            if stretch:
                end = max(end, snapshot.base + len(snapshot.messages) - KEEP_RECENT)
            at = snapshot.base + snapshot.last_consolidated
            if not start <= at < end:
                return None  # consolidated meanwhile
            budget = self.rt.config.consolidate_above_tokens
            part = part_of(snapshot.messages[at - snapshot.base : end - snapshot.base], budget)
            if not part:
                return None  # (rows the load left out: nothing to fold here)
            owner = await self.rt.registry.owner_of(key)
            if owner not in (None, self.rt.worker_id):  # its lease would be forwarded
                log.info("consolidation of %s left: a private session holds its key", safe(key))
                return None  # (the stored session's next commit queues it again)
            scope = snapshot.scope
            # one memory, one fold here at a time (another would be made again from the
            # memory that one writes); and one a user: a bot's end users are scopes of
            # their own that count as the bot's (its quota), and four of them held the
            # channel's whole share (a helper's attack, stop 52)
            busy = {scope, snapshot.share_owner}
            if busy & self._folding:
                log.info("consolidation of %s put off: its scope or user folds", safe(key))
                raise _ScopeBusyError
            self._folding |= busy
            try:
                cap = max(budget, MIN_PART_TOKENS) * 4  # characters (a row over a part)
                folded = await fold(self.rt, scope, part, max_chars=cap)
                result = await self._commit(snapshot, at, at + len(part), folded)
            finally:
                self._folding -= busy
            if result == "ok":
                return at + len(part), end
            if result != "memory_moved":
                return None
        log.warning("consolidation of %s gave up: its memory kept changing", safe(key))
        return None

    async def _commit(self, folded_from: Session, start: int, end: int, folded: Fold) -> str:
        """Under the lease: write ``folded`` if the stored session is still the one it
        was made from. Another one under the same key (deleted meanwhile and started
        again, maybe by another sender, of another scope) is "moved": its rows were not
        read, and the fold of the old conversation must not reach its scope's memory."""
        key = folded_from.key
        acquired, _scope = await Acquirer(self.rt).acquire_blocking(key)
        try:
            session = await self.rt.sessions.load_for_turn(
                key, acquired.version, acquired.generation
            )
            if (
                session.generation != folded_from.generation
                or session.scope != folded_from.scope
                or session.base + session.last_consolidated != start
                or session.base + len(session.messages) < end
            ):
                return "moved"
            session.last_consolidated = end - session.base
            result = await self.rt.bus.consolidate(
                key,
                acquired.token,
                meta=encode_meta(session),
                version=acquired.version,
                scope=session.scope,
                memory=folded.memory,
                memory_version=folded.memory_version,
                history=folded.history,
            )
            self.rt.sessions.invalidate_stored(key)  # reload: version (and memory) moved
            if result not in ("ok", "memory_moved"):
                log.warning("consolidation of %s not committed: %s", safe(key), result)
            return result
        finally:
            await self.rt.bus.release(key, acquired.token)
