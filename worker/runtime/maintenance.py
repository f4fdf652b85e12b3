"""Periodic work of a worker: heartbeat, transient-owner renewal, channel discovery, and
recovery of sessions whose notification, lease holder or transient owner was lost."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from bus_redis.codec import safe, stream_id_ms, text
from bus_redis.keys import UNIFIED_CHANNEL
from bus_redis.registry import lost_event
from bus_redis.results import Notification
from worker.runtime.context import Runtime
from worker.runtime.registration import eviction_policy, mode_of

log = logging.getLogger(__name__)
DEAD_WORKER_AFTER_TTLS = 6  # a worker silent for this many lease TTLs is forgotten
PRUNE_BATCH = 100  # idle sessions deleted per channel and sweep period at most
RENEW_BATCH = 256  # owner records renewed together (a worker owns up to 1,000 a channel)
POLICY_CHECK_TICKS = 10  # Redis's eviction policy is looked at again every this many ticks


class Maintenance:
    def __init__(
        self,
        rt: Runtime,
        *,
        dispatch: Callable[[list[Notification]], None],
        serving: Callable[[str], bool],
        set_channels: Callable[[set[str]], None],
        streams: Callable[[], list[str]],
        periodic: Callable[[set[str]], Awaitable[Any]] | None = None,
        left_by: Callable[[str, set[str]], Awaitable[Any]] | None = None,
        left_here: Callable[[set[str]], Awaitable[Any]] | None = None,
    ) -> None:
        self.rt = rt
        self.streams = streams  # the notification streams the consumer reads
        self.periodic = periodic  # more work per tick over the served channels (schedules)
        # what a worker gone for good left running (its subagents): the liveness takeover
        # runs it again within a second; a worker pruned here was silent longer than the
        # liveness watch remembers (or liveness is off)
        self.left_by = left_by
        # this worker's own entries of jobs not running here (a former life's whose
        # queueing failed at start, or given back by a survivor after a stall): again
        self.left_here = left_here
        self.dispatch = dispatch
        self.serving = serving  # whether a holder runs for this key here
        self.set_channels = set_channels
        self.channels: set[str] = set()
        self.started_ms = int(time.time() * 1000)
        self.ticks = 0
        # another process claimed this worker's id (heartbeat.lua): no step runs any more,
        # as what names the id is the other's (its private sessions' records, its inbox)
        self.id_taken = False

    @property
    def every_s(self) -> float:
        return self.rt.bus.lock_ttl_ms / 3000

    async def run(self) -> None:
        while True:
            try:
                await self.tick()
            except (RedisError, OSError) as exc:
                log.warning("maintenance skipped: %s", type(exc).__name__)
            except Exception:  # a bug in one step must not stop recovery for good
                log.exception("maintenance tick failed")
            await asyncio.sleep(self.every_s)

    async def refresh_channels(self, *, discover: bool = False) -> set[str]:
        registry = self.rt.registry
        found = await registry.registered_channels() | set(self.rt.config.channels)
        if discover:
            found |= await registry.discover_channels()
        if found != self.channels:
            self.channels = found
            self.set_channels(found)
        return found

    async def tick(self) -> None:
        rt = self.rt
        if self.id_taken:
            return
        self.ticks += 1
        if self.ticks % POLICY_CHECK_TICKS == 0:
            policy = await eviction_policy(rt.bus)
            if policy is not None:  # checked at start; an operator changed it since
                log.error(
                    "Redis now evicts keys (maxmemory-policy %s): leases, queued messages and "
                    "history can vanish; set maxmemory-policy noeviction",
                    policy,
                )
        # each step on its own: one that fails for a reason of its own (a key of an
        # unexpected type, a bug) must not skip the others, tick after tick; Redis out of
        # reach ends the tick (every step would fail)
        steps: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
            ("heartbeat", self.heartbeat),
            ("queue observation", self.observe_queues),
            ("channel refresh", self.refresh_channels),
            ("idle private sessions", self.close_idle),
            ("owner renewal", self.renew_owned),
            ("owner check", self.check_owned),
            ("lease sweep", self._leases),
            ("stranded-stream sweep", self.sweep),
            ("schedules", self._periodic),
            ("stale notifications", self._claims),
            ("lost owners", self._lost_owners),
            ("dead workers", self._prune_workers),
            ("jobs left here", self._left_here),
        ]
        for name, step in steps:
            try:
                await step()
            except (RedisConnectionError, RedisTimeoutError, OSError):
                raise
            except Exception:
                log.exception("maintenance step failed: %s", name)
            if self.id_taken:  # (the heartbeat found it: the rest is not this one's)
                return

    async def _leases(self) -> None:
        rt = self.rt
        channels = self.channels | ({UNIFIED_CHANNEL} if rt.config.unified_session else set())
        for key in await rt.registry.sweeps.leases(channels):
            log.info("lease of %s expired without release; re-notified", safe(key))

    async def _periodic(self) -> None:
        if self.periodic is not None:
            await self.periodic(self.channels)

    async def _claims(self) -> None:
        rt = self.rt
        stale = await rt.bus.claim_stale(
            rt.worker_id, self.streams(), min_idle_ms=rt.bus.lock_ttl_ms
        )
        if stale:
            log.info("claimed %d notifications unacknowledged for a lease TTL", len(stale))
            self.dispatch(stale)

    async def _lost_owners(self) -> None:
        rt = self.rt
        for member in await rt.registry.due_owners(self.channels):
            await rt.registry.report_owner_lost(member, lost_event(member))

    async def _prune_workers(self) -> None:
        rt = self.rt
        dead = await rt.registry.prune_dead_workers(
            older_than_ms=rt.bus.lock_ttl_ms * DEAD_WORKER_AFTER_TTLS, streams=self.streams()
        )
        if self.left_by is not None:
            channels = self.channels | ({UNIFIED_CHANNEL} if rt.config.unified_session else set())
            for worker in dead:
                if worker != rt.worker_id:
                    await self.left_by(worker, set(channels))

    async def _left_here(self) -> None:
        if self.left_here is not None:
            rt = self.rt
            channels = self.channels | ({UNIFIED_CHANNEL} if rt.config.unified_session else set())
            await self.left_here(set(channels))

    async def heartbeat(self) -> None:
        rt = self.rt
        info = {
            "host": socket.gethostname(),
            "pid": str(os.getpid()),
            "started_ms": str(self.started_ms),
            "active": str(len(rt.turns)),
            "transient": str(len(rt.turns.owned())),
            # status calls a worker dead once its heartbeat is older than this
            "dead_after_ms": str(rt.bus.lock_ttl_ms),
            # others judge its liveness beat by this, if it is longer than their own
            "liveness_ms": str(rt.config.liveness_ms),
            **{name: str(count) for name, count in rt.turns.metrics.items()},
        }
        taken = await rt.registry.heartbeat(
            rt.worker_id, info, ttl_ms=rt.bus.lock_ttl_ms * 3, claim=rt.claim,
            mode=mode_of(unified=rt.config.unified_session, single_owner=rt.config.single_owner),
        )  # fmt: skip
        if taken is not None:
            self.id_taken = True
            rt.on_id_taken(*taken)

    async def observe_queues(self) -> None:
        """The age of the oldest notification not yet taken, over the served channels'
        ready queues (one ``XRANGE ... COUNT 1`` each, pipelined)."""
        channels = sorted(self.channels)
        if not channels:
            self.rt.metrics.oldest_queued_seconds.set(0)
            return
        async with self.rt.bus.raw.pipeline(transaction=False) as pipe:
            for channel in channels:
                pipe.xrange(self.rt.bus.keys.ready(channel), "-", "+", count=1)
            pipe.time()
            replies = await pipe.execute(raise_on_error=False)
        seconds, micros = replies[-1]
        now_ms = int(seconds) * 1000 + int(micros) // 1000
        oldest = [stream_id_ms(text(r[0][0])) for r in replies[:-1] if isinstance(r, list) and r]
        age_ms = now_ms - min(oldest) if oldest else 0
        self.rt.metrics.oldest_queued_seconds.set(max(0, age_ms) / 1000)

    async def sweep(self) -> None:
        """Re-notify stranded sessions (one worker per sweep period does it)."""
        rt = self.rt
        if not await rt.registry.take_sweep_turn(rt.worker_id, rt.config.sweep_interval_ms):
            return
        sweeps, unified = rt.registry.sweeps, rt.config.unified_session
        stranded: list[str] = []
        for channel in sorted(self.channels):  # each channel's own index, bounded per call
            try:
                stranded += await sweeps.queued(channel, unified=unified)
            except (RedisError, OSError) as exc:
                log.warning("sweep of channel %s failed: %s", safe(channel), type(exc).__name__)
        if stranded:
            log.info(
                "%d sessions had queued entries and nobody serving them; re-notified", len(stranded)
            )
        await self.prune_idle()
        await self.refresh_channels(discover=True)  # SCAN steps, bounded: for all workers
        await sweeps.hints()
        await sweeps.keyspace(unified=unified)

    async def prune_idle(self) -> None:
        """Durable sessions idle longer than ``session_ttl_s`` go (with their indexes and
        events), at most PRUNE_BATCH per channel and sweep period."""
        rt = self.rt
        ttl_ms = int(rt.config.session_ttl_s * 1000)
        if ttl_ms <= 0:
            return
        channels = self.channels | ({UNIFIED_CHANNEL} if rt.config.unified_session else set())
        for channel in sorted(channels):
            try:
                gone = await rt.sessions.store.prune_idle(
                    channel,
                    ttl_ms,
                    limit=PRUNE_BATCH,
                    schedules_of=self.channels if channel == UNIFIED_CHANNEL else (),
                )
            except (RedisError, OSError) as exc:
                log.warning(
                    "pruning idle sessions of %s failed: %s", safe(channel), type(exc).__name__
                )
                continue
            for key in gone:
                rt.sessions.invalidate_stored(key)  # (a private one on the key: kept)
            if gone:
                log.info(
                    "%d sessions of %s idle for %ds deleted",
                    len(gone),
                    safe(channel),
                    ttl_ms // 1000,
                )

    async def close_idle(self) -> None:
        idle_s = self.rt.config.private_idle_s
        for key in self.rt.turns.idle(idle_s):
            if self.rt.turns.is_idle(key, idle_s):  # still: each close before it took a while
                await self.close_private(key, "the private session was closed after being idle")

    async def renew_owned(self) -> None:
        """Renew our private sessions' owner records; one that ran out ends its session
        (its loss is told by the owners' sweep: a turn running on it is cancelled, so that
        no answer comes after that)."""
        rt = self.rt
        for key, member in rt.turns.redrops().items():
            await rt.drop_owner(key, member)
        owned = list(rt.turns.owned().items())
        for at in range(0, len(owned), RENEW_BATCH):  # (sent together: one round trip)
            batch = owned[at : at + RENEW_BATCH]
            # before: the answer may come after the commit's
            before = [(rt.turns.is_opening(key), rt.turns.epoch(key)) for key, _ in batch]
            renewed = await asyncio.gather(
                *(rt.registry.renew_owner(key, rt.worker_id, member) for key, member in batch)
            )
            for (key, _), (opening, epoch), ok in zip(batch, before, renewed, strict=True):
                if ok or opening or rt.turns.is_opening(key) or rt.turns.epoch(key) != epoch:
                    continue  # its opening commit is (or was) on its way; or it is another
                rt.lost(key)

    async def check_owned(self) -> None:
        """Serve our transient sessions that have messages but no notification reached
        us (a forwarding worker died between its acquire and its forward)."""
        inbox = self.rt.bus.keys.inbox(self.rt.worker_id)
        for key in await self.rt.registry.unserved(list(self.rt.turns.owned())):
            if not self.serving(key):
                self.dispatch([Notification(inbox, "", key)])

    async def close_private(self, key: str, why: str) -> None:
        """End a private session here: its frontend is told (``session_lost``), later
        messages get ``session_not_active``."""
        rt = self.rt
        member = rt.turns.owned().get(key)
        if member is None or key in rt.turns.running() or rt.turns.is_opening(key):
            return  # (busy: closed once idle again)
        # held (and owned, for leave() should a stop cancel this) until reported, but
        # closing: a notification read meanwhile (the loss report re-notifies S) must not
        # acquire S claiming the session, which would write its record again, and a turn
        # does not run on it. A failed abandon leaves it served, closed at the next tick; a
        # failed report leaves the loss to the owners' sweep (the record is gone).
        rt.turns.closing(key, True)
        try:
            await rt.registry.abandon_owner(key, rt.worker_id)
            await rt.registry.report_owner_lost(member, lost_event(member, why))
            if rt.turns.is_closing(key):  # (opened again meanwhile: a session to keep)
                rt.forget(key)
        finally:
            rt.turns.closing(key, False)

    async def leave(self) -> None:
        """On shutdown: our transient sessions die with us; tell their frontends now."""
        rt = self.rt
        for key, member in rt.turns.owned().items():
            rt.turns.closing(key, True)  # as in close_private
            try:
                await rt.registry.abandon_owner(key, rt.worker_id)
                await rt.registry.report_owner_lost(member, lost_event(member))
            except (RedisError, OSError):
                log.warning("could not report a transient session as lost")
            if rt.turns.is_closing(key):
                rt.forget(key)
        for key, member in rt.turns.redrops().items():  # no record left naming us
            with contextlib.suppress(RedisError, OSError):
                await rt.registry.drop_owner(key, rt.worker_id, member)
        if rt.background:
            await asyncio.wait(set(rt.background), timeout=2)
        streams = self.streams()
        try:
            handed = await rt.bus.hand_back(rt.worker_id, streams)
            if handed:
                log.info("handed %d unserved notifications back to the queue", handed)
            await rt.registry.leave(rt.worker_id, streams)
        except (RedisError, OSError):
            log.warning("could not deregister worker %s", rt.worker_id)
