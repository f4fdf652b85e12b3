"""AgentLoop: the worker. Reads session notifications, holds leases, runs turns.

    run()
     ├── ControlListener        pub/sub controls, a connection per channel -> cancel turns
     ├── _consume()             channels' ready queues + own inbox -> one _serve() task each
     │     └── _serve()         acquire lease -> SessionHolder drains the session
     └── Maintenance            heartbeats, owners, channel discovery, sweeps

The per-entry logic (decode, policy checks, the turn, the commit spec) is in
``worker.runtime.holder``; in-flight state is owned by ``worker.runtime.inflight.TurnRegistry``; this
module owns lifecycle, concurrency and the wiring.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from redis.exceptions import RedisError

from bus_redis import ControlMessage, InboundMessage, OutboundMessage, RedisBus
from bus_redis.codec import safe
from bus_redis.keys import UNIFIED_CHANNEL, channel_of
from bus_redis.results import Acquired, Forward, Notification
from bus_redis.streams import Retention
from session_store import MemoryStore, SessionManager
from worker.agent.providers import LLMProvider
from worker.agent.tools import ToolRegistry
from worker.config import LoopConfig
from worker.jobs import JobQueue
from worker.jobs.consolidation import JOB_NAME as CONSOLIDATE_JOB
from worker.jobs.consolidation import Consolidator
from worker.jobs.leftovers import Leftovers
from worker.jobs.schedules import JOB_NAME as CRON_JOB
from worker.jobs.schedules import Schedules
from worker.jobs.services import BackgroundServices
from worker.jobs.subagents import JOB_NAME as SUBAGENT_JOB
from worker.jobs.subagents import Subagents
from worker.runtime.acquiring import Acquirer
from worker.runtime.backoff import TRANSIENT, Backoff
from worker.runtime.context import Runtime
from worker.runtime.controls import Controls
from worker.runtime.direct import process_message
from worker.runtime.faults import crash_point
from worker.runtime.holder import SessionHolder
from worker.runtime.inflight import TurnRegistry
from worker.runtime.lease import held_tokens
from worker.runtime.liveness import Liveness
from worker.runtime.maintenance import Maintenance
from worker.runtime.registration import check_can_serve, end_former_private, id_taken
from worker.runtime.subscription import ControlListener

log = logging.getLogger(__name__)
# Notifications read at once even when fewer slots are free: the extra ones wait for a slot
# (acknowledged only when served; handed back at shutdown, claimed by others after a TTL),
# so a busy worker reads in batches instead of one round trip per freed slot.
READ_BATCH_MIN = 16


class AgentLoop:
    def __init__(
        self,
        bus: RedisBus,
        provider: LLMProvider,
        *,
        sessions: SessionManager | None = None,
        memory: MemoryStore | None = None,
        model: str | None = None,
        unified_session: bool | None = None,
        tools: ToolRegistry | None = None,
        jobs: JobQueue | None = None,
        config: LoopConfig | None = None,
    ) -> None:
        config = config or LoopConfig()
        if unified_session is not None and unified_session != config.unified_session:
            config = config.model_copy(update={"unified_session": unified_session})
        self.config = config
        self.bus = bus
        # one source of timings: the loop's config decides the bus's lease and retention
        bus.lock_ttl_ms, bus.owner_ttl_ms = config.lock_ttl_ms, config.owner_ttl_ms
        bus.retention = Retention(
            config.reply_maxlen,
            config.reply_ttl_ms,
            config.transient_reply_ttl_ms,
            int(config.session_ttl_s * 1000),
        )
        bus.marks_private = config.unified_session
        self.worker_id = config.worker_id
        self.rt = Runtime.build(
            config,
            bus,
            provider,
            sessions=sessions,
            memory=memory,
            model=model,
            tools=tools,
            jobs=jobs,
        )
        self.tools = self.rt.tools
        self.consolidator = Consolidator(self.rt)
        self.rt.maybe_consolidate = lambda s: self.consolidator.maybe_consolidate_by_tokens(s)
        self.controls = Controls(self.rt)
        self.acquirer = Acquirer(self.rt)
        self.rt.look = self.controls.look
        self.rt.on_id_taken = self._on_id_taken
        self.rt.jobs.register(CONSOLIDATE_JOB, self.consolidator.run_job)
        self.subagents = Subagents(self.rt, self.tools)
        self.leftovers = Leftovers(config.worker_id, self.subagents, self.consolidator)
        self.schedules = Schedules(self.rt)
        self.rt.services = BackgroundServices(self.subagents, self.schedules)
        self.rt.jobs.register(SUBAGENT_JOB, self.subagents.run_job)
        self.rt.jobs.register(CRON_JOB, self.schedules.fire)
        self.holders: dict[str, SessionHolder] = {}
        self._serving: set[asyncio.Task[None]] = set()
        self._slots = asyncio.Semaphore(config.concurrency)
        self._stopping = asyncio.Event()
        self._id_taken: tuple[str, str] | None = None  # (host, pid) that claimed our id
        self._abandoned: set[str] = set()  # the start's former private sessions, not told yet
        self._consumer: asyncio.Task[None] | None = None
        self._listener: ControlListener | None = None
        self._streams: list[str] = []
        self._new_streams: list[str] | None = None
        self.maintenance = Maintenance(
            self.rt,
            dispatch=self.dispatch,
            serving=lambda key: key in self.holders,
            set_channels=self._set_channels,
            streams=lambda: list(self._streams),
            periodic=self.schedules.sweep,
            left_by=self.leftovers.rerun,
            left_here=self.leftovers.here,
        )
        self.liveness = Liveness(
            self.rt,
            liveness_ms=config.liveness_ms,
            channels=self._served_channels,
            streams=lambda: list(self._streams),
            dispatch=self.dispatch,
            on_dead=self.leftovers.rerun,
        )
        self.rt.on_new_server.append(self.liveness.new_server)

    # --- the in-process surface (README: Embedding) ---------------------------------------------
    @property
    def sessions(self) -> SessionManager:
        return self.rt.sessions

    @property
    def memory(self) -> MemoryStore:
        return self.rt.memory

    @property
    def jobs(self) -> JobQueue:
        return self.rt.jobs

    @property
    def turns(self) -> TurnRegistry:
        return self.rt.turns

    @property
    def model(self) -> str:
        return self.rt.model

    @property
    def unified_session(self) -> bool:
        return self.config.unified_session

    @property
    def active_tasks(self) -> dict[str, asyncio.Task[Any]]:
        """Effective key -> its running turn task."""
        return self.rt.turns.active_tasks()

    @property
    def metrics(self) -> Any:
        return self.rt.turns.metrics

    # --- keys (worker.runtime.acquiring) ------------------------------------------------------
    def effective_key(self, session_key: str) -> str:
        return self.acquirer.effective_key(session_key)

    # --- in-process API ------------------------------------------------------------
    async def process_message(self, msg: InboundMessage) -> OutboundMessage | None:
        """Run one turn for ``msg`` under the session's Redis lease, commit it, return the
        reply (``worker.runtime.direct``)."""
        return await process_message(self.rt, self.acquirer, msg)

    # --- the worker ------------------------------------------------------------------
    async def run(self) -> None:
        """Consume until :meth:`stop` (also one called before this began); then drain
        within the grace period. The loop may run again after. Raises
        ``WorkerConflictError`` when it stopped because another process claimed its id."""
        self._id_taken = None
        try:
            await self._run()
        finally:
            self._stopping.clear()
            self.rt.turns.stopping = False
        if self._id_taken is not None:
            raise id_taken(self.worker_id, *self._id_taken)

    async def _run(self) -> None:
        listener = self._listener = ControlListener(
            self.bus.raw, self.bus.keys, self.on_control, self.check_flags
        )
        # a full Redis (or one loading, failing over) refuses the start's writes: wait
        # (a refusal, e.g. the id in use by a live worker, leaves at once: the cleanup
        # below would deregister that worker)
        starting = Backoff("starting the worker", log, first_s=0.2, cap_s=5.0)
        if not await starting.until_done(self._start, self._stopping, retry=TRANSIENT):
            await self.bus.aclose()  # stopped while waiting
            return
        background = [
            asyncio.create_task(self.liveness.run_beat(), name="liveness-beat"),
            asyncio.create_task(self.liveness.run_watch(), name="liveness-watch"),
            asyncio.create_task(listener.run(), name="control"),
            asyncio.create_task(self.maintenance.run(), name="maintenance"),
        ]
        try:
            # the job queue's connection may be refused for a while (e.g. at maxclients)
            starting = Backoff("starting the job queue", log, first_s=0.2, cap_s=5.0)
            await starting.until_done(self.rt.jobs.start, self._stopping)
            await asyncio.wait_for(listener.subscribed.wait(), timeout=30)
            self._consumer = asyncio.create_task(self._consume(), name="consume")
            with contextlib.suppress(asyncio.CancelledError):
                await self._consumer
            await self._drain()
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await self.controls.close()
            await self.rt.jobs.aclose()
            if self._id_taken is None:  # (else what names the id is the other process's)
                await self.maintenance.leave()
                with contextlib.suppress(RedisError, OSError):
                    await self.rt.registry.sweeps.forget_dead(self.worker_id)
            await self.bus.aclose()
            log.info("worker %s stopped", safe(self.worker_id))

    async def _start(self) -> None:
        """What a start writes, each step safe to run again."""
        self.rt.claim = await check_can_serve(
            self.bus,
            self.worker_id,
            unified=self.config.unified_session,
            single_owner=self.config.single_owner,
        )
        await self.bus.scripts.load_all()
        # alive before anything is acquired (an old beat of this id would look dead); with
        # no beats, a former life's beat goes, or others would take this life's leases
        sweeps = self.rt.registry.sweeps
        await (sweeps.beat if self.liveness.enabled else sweeps.forget_dead)(self.worker_id)
        await self.maintenance.refresh_channels(discover=True)
        self._set_channels(self.maintenance.channels)
        await self._apply_streams()
        # leases still held under this worker id are a former life's (killed, restarted
        # under the same id before anyone noticed): hand them over at once
        await self.rt.registry.sweeps.takeover(
            self._served_channels(), self.worker_id, dead_after_ms=None,
            keep=held_tokens(self.bus),  # (an in-process turn running now: this life's)
        )  # fmt: skip
        # ... and the jobs it ran, and its private sessions end (told as lost)
        await self.leftovers.rerun(self.worker_id, self._served_channels())
        await end_former_private(
            self.rt.registry, self.worker_id, self._served_channels(), self._abandoned
        )

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def _on_id_taken(self, host: str, pid: str) -> None:
        """Another process claimed this worker's id while this one was stopped (past its
        record's life): this one stops, leaving what names the id alone (the other's)."""
        if self._id_taken is None:
            log.error(
                "worker id %s was claimed by pid %s on %s while this process was stopped: "
                "stopping (give each worker its own AGENT_WORKER_ID)",
                safe(self.worker_id), safe(pid), safe(host),
            )  # fmt: skip
        self._id_taken = (host, pid)
        self.stop()

    def stop(self) -> None:
        """Request a graceful stop (idempotent; safe from a signal handler)."""
        self._stopping.set()
        self.rt.turns.stopping = True
        if self._consumer is not None and not self._consumer.done():
            self._consumer.cancel()

    def _served_channels(self) -> set[str]:
        channels = set(self.maintenance.channels)
        return channels | {UNIFIED_CHANNEL} if self.config.unified_session else channels

    def _set_channels(self, channels: set[str]) -> None:
        if self._listener is not None:
            self._listener.set_channels(channels)
        if self.config.unified_session:
            channels = channels | {UNIFIED_CHANNEL}
        self._new_streams = self.bus.note_streams(self.worker_id, channels)

    async def _apply_streams(self) -> None:
        if self._new_streams is not None and self._new_streams != self._streams:
            await self.bus.ensure_groups(self._new_streams)
            self._streams = self._new_streams
        self._new_streams = None

    async def _consume(self) -> None:
        backoff = Backoff("reading the ready queues", log)
        while not self._stopping.is_set():
            await self._slots.acquire()
            free = max(READ_BATCH_MIN, 1 + self._free_slots())
            try:
                await self._apply_streams()
                notes = await self.bus.read_notifications(
                    self.worker_id, self._streams, count=free, block_ms=self.config.read_block_ms
                )
            except (RedisError, OSError) as exc:
                await backoff.after(exc)
                self._new_streams = self._new_streams or list(self._streams)
                self._streams = []  # groups are re-created: the server may have lost them
                continue
            except Exception as exc:  # a bug must not end the consumer (nor the worker)
                log.exception("reading the ready queues failed")
                await backoff.after(exc)
                continue
            finally:
                self._slots.release()
            backoff.reset()
            if notes:
                crash_point("after_read")
            self.dispatch(notes)

    def _free_slots(self) -> int:
        return max(0, self.config.concurrency - len(self._serving) - 1)

    def dispatch(self, notes: list[Notification]) -> None:
        for note in notes:
            task = asyncio.create_task(self._serve(note), name="serve")
            self._serving.add(task)
            task.add_done_callback(self._serving.discard)

    async def _serve(self, note: Notification) -> None:
        async with self._slots:
            if self._stopping.is_set():  # read but not served: handed back at shutdown
                return
            try:
                await self._serve_note(note)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("serving %s failed", safe(note.session_key))

    async def _serve_note(self, note: Notification) -> None:
        if note.effective and channel_of(note.session_key) == UNIFIED_CHANNEL:
            key, member = note.session_key, ""  # the streams pending under the unified key
        else:  # any other key is its own stream: served as a plain notification of it, so
            # that in unified mode a stream folded meanwhile is served under the unified
            # key, never under a lease of its own while the unified holder runs its entry
            key, member = self.effective_key(note.session_key), note.session_key
        key, result, scope = await self.acquirer.acquire(key, member=member, note=note)
        crash_point("after_acquire")
        if isinstance(result, Forward):
            # A forward lost to a crash right here is recovered by the owner's own
            # periodic check of its sessions, or by the stranded-stream sweep.
            await self.bus.forward(result.owner, note)
            return
        if not isinstance(result, Acquired):
            return
        holder = SessionHolder(self.rt, key, result, {member} if member else set(), scope)
        self.holders[key] = holder
        try:
            await holder.drain()
        finally:
            # ours only: a holder of K whose lease was taken over may end after this
            # worker took K again (a newer holder is then the one serving K here)
            if self.holders.get(key) is holder:
                del self.holders[key]

    async def _drain(self) -> None:
        """Let running sessions finish within the grace period, then cancel the rest;
        their leases are released at once (no other worker waits for a TTL)."""
        if self._serving:
            _, pending = await asyncio.wait(
                set(self._serving), timeout=self.config.shutdown_grace_s
            )
            for key, holder in list(self.holders.items()):
                holder.abort("shutdown")
                log.info("shutdown cancels the turn of %s", safe(key))
            if pending:
                await asyncio.wait(pending, timeout=5)

    # --- control (worker.runtime.controls) ---------------------------------------------------
    def on_control(self, control: ControlMessage) -> None:
        self.controls.on_control(control)
        self.subagents.on_control(control)

    async def check_flags(self) -> None:
        await self.controls.check_missed()
