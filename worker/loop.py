"""AgentLoop: the worker. Reads session notifications, holds leases, runs turns.

    run()
     ├── ControlListener        pub/sub controls (stop / discard) -> cancel turns
     ├── _consume()             ready queue + own inbox -> one _serve() task each
     │     └── _serve()         acquire lease -> SessionHolder drains the session
     └── Maintenance            heartbeats, owner renewal, dead-holder sweep

The per-entry logic (decode, policy checks, the turn, the commit spec) is in
``worker.holder``; this module owns lifecycle, concurrency and cancellation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from typing import Any

from redis.exceptions import RedisError

from bus_redis import SESSION_NOT_ACTIVE, ControlMessage, InboundMessage, OutboundMessage, RedisBus
from bus_redis.results import Acquired, Busy, CommitSpec, Forward, Notification
from session_store import (
    UNIFIED_SESSION_KEY,
    MemoryStore,
    RedisSessionStore,
    SessionManager,
)
from worker.backoff import Backoff
from worker.config import LoopConfig
from worker.consolidator import JOB_NAME as CONSOLIDATE_JOB
from worker.consolidator import Consolidator
from worker.context import ContextBuilder
from worker.control import ControlListener
from worker.faults import crash_point
from worker.holder import SessionHolder
from worker.jobs import JobQueue, LocalJobQueue
from worker.maintenance import Maintenance
from worker.outcomes import SessionNotActiveError
from worker.providers import LLMProvider
from worker.tools import ToolRegistry, default_registry
from worker.turn import TurnRunner

log = logging.getLogger(__name__)


class AgentLoop:
    def __init__(
        self,
        bus: RedisBus,
        provider: LLMProvider,
        *,
        sessions: SessionManager | None = None,
        memory: MemoryStore | None = None,
        model: str | None = None,
        unified_session: bool = False,
        tools: ToolRegistry | None = None,
        jobs: JobQueue | None = None,
        config: LoopConfig | None = None,
    ) -> None:
        self.bus = bus
        self.provider = provider
        self.config = config or LoopConfig()
        self.worker_id = self.config.worker_id
        self.sessions = sessions or SessionManager(RedisSessionStore(bus.redis, bus.keys))
        self.memory = memory or MemoryStore(bus.redis, bus.keys)
        self.model = model or provider.get_default_model()
        self.unified_session = unified_session
        self.tools = tools or default_registry()
        self.context = ContextBuilder(self.tools.names, history_tokens=self.config.history_tokens)
        self.runner = TurnRunner(
            provider, self.tools, self.context, self.model, self.config.max_iterations
        )
        self.consolidator = Consolidator(self)
        self.jobs: JobQueue = jobs or LocalJobQueue()
        self.jobs.register(CONSOLIDATE_JOB, self.consolidator.run_job)
        self.active_tasks: dict[str, set[asyncio.Task[Any]]] = {}
        self.cancel_reasons: dict[asyncio.Task[Any], str] = {}
        self.active_members: dict[str, str] = {}  # effective key -> inbound stream being served
        self.owned: dict[str, str] = {}  # transient key -> owners-registry member
        self.since_ms: dict[str, int] = {}  # key -> when its turn / ownership began
        self.holders: dict[str, SessionHolder] = {}
        self.metrics: Counter[str] = Counter()  # leases_lost, fenced_writes_rejected, ...
        self._serving: set[asyncio.Task[None]] = set()
        self._slots = asyncio.Semaphore(self.config.concurrency)
        self._stopping = asyncio.Event()
        self._consumer: asyncio.Task[None] | None = None
        self.maintenance = Maintenance(self)

    # --- keys ------------------------------------------------------------------
    def effective_key(self, session_key: str, *, direct: bool) -> str:
        """Unified mode folds direct chats into one session; transient ones stay out."""
        if self.unified_session and direct and not self.sessions.is_transient(session_key):
            return UNIFIED_SESSION_KEY
        return session_key

    def key_for(self, msg: InboundMessage) -> str:
        return self.effective_key(msg.session_key, direct=msg.session_key_override is None)

    # --- in-process API ------------------------------------------------------------
    async def process_message(self, msg: InboundMessage) -> OutboundMessage | None:
        """Run one turn for ``msg`` under the session's Redis lease and commit it.

        Raises ``RuntimeError("required session is not active")`` when the message
        requires a live session this worker does not hold.
        """
        key = self.key_for(msg)
        if msg.require_existing_session and not self.sessions.is_transient(key):
            raise SessionNotActiveError(SESSION_NOT_ACTIVE)
        acquired = await self._acquire_blocking(key)
        holder = SessionHolder(self, key, acquired, set())
        holder.lease.start()
        try:
            outcome = await holder.run_message(msg, reply_to=msg.id or "", member=key)
            spec = CommitSpec(member=key)
            holder.fill_spec(spec, outcome)
            spec.reply = ""  # returned to the caller, as the reference loop does
            await holder.commit(spec, select=None)
            return outcome.reply
        finally:
            await holder.lease.stop()
            if not holder.lease.lost:
                await self.bus.release(key, acquired.token)

    async def _acquire_blocking(self, key: str) -> Acquired:
        delay_s = 0.005
        while True:
            claim = self.sessions.is_transient(key)
            result = await self.bus.acquire(key, self.worker_id, claim_owner=claim, select=False)
            if isinstance(result, Acquired):
                return result
            if isinstance(result, Forward):
                raise SessionNotActiveError(f"session is owned by worker {result.owner}")
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, 0.1)

    # --- the worker ------------------------------------------------------------------
    async def run(self) -> None:
        """Consume until :meth:`stop`; then drain within the grace period."""
        self._stopping.clear()
        await self.bus.ensure_groups(self.worker_id)
        listener = ControlListener(
            self.bus.redis, self.bus.keys.control, self.on_control, self.check_flags
        )
        background = [
            asyncio.create_task(listener.run(), name="control"),
            asyncio.create_task(self.maintenance.run(), name="maintenance"),
        ]
        try:
            await self.jobs.start()
            await asyncio.wait_for(listener.subscribed.wait(), timeout=30)
            self._consumer = asyncio.create_task(self._consume(), name="consume")
            with contextlib.suppress(asyncio.CancelledError):
                await self._consumer
            await self._drain()
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await self.jobs.aclose()
            await self.maintenance.leave()
            log.info("worker %s stopped", self.worker_id)

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def stop(self) -> None:
        """Request a graceful stop (idempotent; safe from a signal handler)."""
        self._stopping.set()
        if self._consumer is not None and not self._consumer.done():
            self._consumer.cancel()

    async def _consume(self) -> None:
        backoff = Backoff("reading the ready queue", log)
        while not self._stopping.is_set():
            await self._slots.acquire()
            free = 1 + self._free_slots()
            try:
                notes = await self.bus.read_notifications(
                    self.worker_id, count=free, block_ms=self.config.read_block_ms
                )
            except (RedisError, OSError) as exc:
                await backoff.after(exc)
                await self._ensure_groups_quietly()
                continue
            finally:
                self._slots.release()
            backoff.reset()
            if notes:
                crash_point("after_read")
            self.dispatch(notes)

    async def _ensure_groups_quietly(self) -> None:
        """After an outage the server may have lost the groups (no persistence)."""
        with contextlib.suppress(RedisError, OSError):
            await self.bus.ensure_groups(self.worker_id)

    def _free_slots(self) -> int:
        return max(0, self.config.concurrency - len(self._serving) - 1)

    def dispatch(self, notes: list[Notification]) -> None:
        for note in notes:
            task = asyncio.create_task(self._serve(note), name=f"serve:{note.session_key}")
            self._serving.add(task)
            task.add_done_callback(self._serving.discard)

    async def _serve(self, note: Notification) -> None:
        async with self._slots:
            try:
                await self._serve_note(note)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("serving %s failed", note.session_key)

    async def _serve_note(self, note: Notification) -> None:
        key = (
            note.session_key
            if note.effective
            else self.effective_key(note.session_key, direct=note.direct)
        )
        member = "" if note.effective else note.session_key
        result = await self.bus.acquire(
            key,
            self.worker_id,
            member=member,
            claim_owner=self.sessions.is_transient(key),
            ack=note,
        )
        crash_point("after_acquire")
        if isinstance(result, Forward):
            # A forward lost to a crash right here is recovered by the owner's own
            # periodic check of its sessions (Maintenance.check_owned).
            await self.bus.forward(result.owner, note)
        if isinstance(result, Forward | Busy):
            return
        holder = SessionHolder(self, key, result, {member} if member else set())
        self.holders[key] = holder
        try:
            await holder.drain()
        finally:
            self.holders.pop(key, None)

    async def _drain(self) -> None:
        """Let running sessions finish within the grace period, then cancel the rest;
        their leases are released at once (no other worker waits for a TTL)."""
        if self._serving:
            _, pending = await asyncio.wait(
                set(self._serving), timeout=self.config.shutdown_grace_s
            )
            for key, holder in list(self.holders.items()):
                holder.abort("shutdown")
                log.info("shutdown cancels the turn of %s", key)
            if pending:
                await asyncio.wait(pending, timeout=5)

    # --- control -----------------------------------------------------------------------
    def on_control(self, control: ControlMessage) -> None:
        """Cancel the running turn of the named session; discard also forgets it."""
        target = control.session_key
        for key in [
            k for k in self.active_tasks if k == target or self.active_members.get(k) == target
        ]:
            for task in self.active_tasks.get(key, ()):
                self.cancel_reasons[task] = control.op
                task.cancel()
        if control.op == "discard":
            self.forget(target)

    def forget(self, key: str) -> None:
        transient = self.sessions.is_transient(key)
        self.sessions.invalidate(key)
        member = self.owned.pop(key, None)
        if transient and member is not None:
            self.maintenance.spawn(self.maintenance.drop_owner(key, member))

    async def check_flags(self) -> None:
        """After (re)subscribing: apply controls published while we were not listening."""
        watched = set(self.active_members.values()) | set(self.active_tasks) | set(self.owned)
        for key, op in (await self.maintenance.read_flags(sorted(watched))).items():
            self.on_control(ControlMessage(op=op, session_key=key))  # type: ignore[arg-type]
