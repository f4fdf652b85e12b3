"""Liveness: a dead worker's sessions are taken over in under a second, a slow one keeps them.

Leases last ``AGENT_LOCK_TTL_MS`` (10 s) so that a worker whose event loop is busy, or
whose Redis is briefly slow, never loses a session it is still serving. Waiting for that
TTL after a crash is what made failover take 9-15 s. Liveness is a separate, short
signal:

- **the beat**: every ``liveness_ms / 8`` the worker writes Redis' time into ``P:alive``
  (``lua/beat.lua``), from a thread of its own with its own connection when it runs as a
  process, so a busy or stalled event loop does not stop it: only a dead (or frozen)
  process stops beating;
- **the watch**: every ``liveness_ms / 8`` each worker asks for workers whose beat is older
  than ``liveness_ms`` (``lua/dead.lua``, Redis' clock), deletes their leases in the
  channels it serves, compare-and-delete, re-notifies those keys (``lua/takeover.lua``)
  and claims the notifications they had read; any worker then acquires the keys with a
  new nonce, so a frozen holder that wakes up is fenced like any lost lease.

A lease whose holder still beats is never taken over; a holder that stops renewing but
keeps beating (a deadlocked loop) loses its leases when they run out, as before. A worker
whose own beat fails (Redis out of memory or read-only refuses every write) judges no one
meanwhile: the others' beats fail alike.
``liveness_ms = 0`` turns the takeover off (failover after the lease TTL only).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable

import redis

from bus_redis.codec import safe
from bus_redis.results import Notification
from bus_redis.scripts import script_source
from worker.runtime.context import Runtime

log = logging.getLogger(__name__)


class Liveness:
    def __init__(
        self,
        rt: Runtime,
        *,
        liveness_ms: int,
        channels: Callable[[], set[str]],
        streams: Callable[[], list[str]],
        dispatch: Callable[[list[Notification]], None],
        beat_client: redis.Redis | None = None,
        on_dead: Callable[[str, set[str]], Awaitable[object]] | None = None,
    ) -> None:
        self.rt = rt
        self.liveness_ms = liveness_ms
        self.every_s = liveness_ms / 8000
        self.channels = channels
        self.streams = streams
        self.dispatch = dispatch
        self.on_dead = on_dead  # what else a dead worker left running (its subagents)
        self.beat_client = beat_client  # sync: beats from a thread
        self._done: dict[str, set[str]] = {}  # dead worker -> channels taken over here
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # when this worker's own beat last landed (monotonic s; set from the beat thread),
        # and since when its beats have been landing without a break: another worker's
        # silence is only told from an outage of Redis (every beat failed alike, and
        # after a restart every other's last beat is from before it) once this worker's
        # own beats have landed for as long as that worker may be silent
        self.beat_ok_at = float("-inf")
        self.beat_ok_since = float("inf")
        self._blind = False  # the watch is skipping: logged once per stretch

    @property
    def enabled(self) -> bool:
        return self.liveness_ms > 0

    def new_server(self) -> None:
        """Redis is another server than before (a restart from an older snapshot, a
        failover to a replica that lagged): the beats it holds may all be old, though no
        beat of this worker failed (a restart between two beats, a client that retried on
        its own). The streak starts again: no other worker is judged before this one's
        beats have landed on this server for a liveness period, by which time the live
        ones have beaten there too."""
        self.beat_ok_since = max(self.beat_ok_since, time.monotonic())

    # --- the beat -------------------------------------------------------------------
    async def run_beat(self) -> None:
        """Beat until cancelled: in a thread when a sync client was given, else here."""
        if not self.enabled:
            return
        self._stop.clear()  # a loop may run again
        if self.beat_client is not None:
            self._thread = threading.Thread(
                target=self._beat_thread, name="liveness-beat", daemon=True
            )
            self._thread.start()
            try:
                await asyncio.Event().wait()
            finally:
                self._stop.set()
                await asyncio.to_thread(self._thread.join, 3)  # > the socket timeout: no
                # beat lands after the worker forgot its entry
            return
        while True:
            try:
                await self.rt.registry.sweeps.beat(self.rt.worker_id)
                self._landed()
            except (redis.RedisError, OSError) as exc:
                self.beat_ok_since = float("inf")
                log.debug("liveness beat failed: %s", type(exc).__name__)
            await asyncio.sleep(self.every_s)

    def _beat_thread(self) -> None:
        assert self.beat_client is not None
        script = self.beat_client.register_script(script_source("beat"))
        alive, me = self.rt.bus.keys.alive, self.rt.worker_id
        failing = False
        while not self._stop.is_set():
            try:
                script(keys=[alive], args=[me])
                self._landed()
                failing = False
            except (redis.RedisError, OSError) as exc:
                self.beat_ok_since = float("inf")
                if not failing:
                    log.warning("liveness beat failed: %s", type(exc).__name__)
                failing = True
            self._stop.wait(self.every_s)
        with contextlib.suppress(Exception):
            self.beat_client.close()

    def _landed(self) -> None:
        """A beat landed: the streak goes on, or starts again after a failure or a gap
        longer than the liveness limit (a beat that hung on a Redis that was away)."""
        now = time.monotonic()
        if self.beat_ok_since == float("inf") or now - self.beat_ok_at > self.liveness_ms / 1000:
            self.beat_ok_since = now
        self.beat_ok_at = now

    # --- the watch ------------------------------------------------------------------
    async def run_watch(self) -> None:
        """Take over dead workers' leases until cancelled."""
        if not self.enabled:
            return
        while True:
            try:
                await self.watch_once()
            except (redis.RedisError, OSError) as exc:
                log.debug("liveness watch skipped: %s", type(exc).__name__)
            except Exception:  # a bug here must not end failover for good
                log.exception("liveness watch failed")
            await asyncio.sleep(self.every_s)

    async def _left_running(self, worker: str, channels: set[str]) -> None:
        if self.on_dead is None:
            return
        try:
            await self.on_dead(worker, channels)
        except Exception:  # the takeover itself is done: it must not be undone by this
            log.exception("restarting what worker %s left running failed", safe(worker))

    async def watch_once(self) -> list[str]:
        """One look: the keys taken over from dead workers (in the served channels). Only
        while this worker's own beat lands: when it cannot (Redis out of memory or
        read-only refuses every beat), the others' beats stop for the same reason, and
        taking over their leases would redo every running turn; their leases then run
        out after their TTL if they really died."""
        if time.monotonic() - self.beat_ok_at > self.liveness_ms / 1000:
            # (before its first beat landed, at start, there is nothing to warn of: the
            # beat's own failure is logged where it fails)
            if not self._blind and self.beat_ok_at > float("-inf"):
                log.warning("own liveness beat is failing: not judging other workers meanwhile")
                self._blind = True
            return []
        self._blind = False
        rt = self.rt
        sweeps = rt.registry.sweeps
        forget = max(6 * rt.bus.lock_ttl_ms, 10 * self.liveness_ms)  # leases ran out by then
        dead = await sweeps.dead_workers(self.liveness_ms, forget_after_ms=forget)
        dead = [w for w in dead if w != rt.worker_id]
        self._done = {w: c for w, c in self._done.items() if w in dead}  # bounded
        taken: list[str] = []
        for worker in dead:
            channels = self.channels() - self._done.get(worker, set())
            if not channels:
                continue
            # judged by its own AGENT_LIVENESS_MS when that is longer (it beats less often:
            # a rolling change of the setting must not take a live worker's turns)
            after = max(self.liveness_ms, await rt.registry.declared_liveness(worker))
            if time.monotonic() - self.beat_ok_since < after / 1000:
                continue  # own beats not landing long enough to tell its silence from an outage
            if after > self.liveness_ms and not await sweeps.still_dead(worker, after):
                continue
            keys = await sweeps.takeover(channels, worker, dead_after_ms=after)
            notes: list[Notification] = []
            if await sweeps.still_dead(worker, after):  # not restarted meanwhile
                notes = await rt.bus.claim_from(rt.worker_id, worker, self.streams())
                await self._left_running(worker, channels)
            self._done.setdefault(worker, set()).update(channels)
            if keys or notes:
                log.warning(
                    "worker %s stopped beating: took over %d leases and %d notifications",
                    safe(worker),
                    len(keys),
                    len(notes),
                )
            if notes:
                self.dispatch(notes)
            taken += keys
        return taken
