"""A held session lease: renewed in the background; losing it cancels the turn at once.

Renewal is due every third of the TTL. Most turns end long before that, so a task per
lease (started, cancelled and awaited on every turn) was pure cost: one ``Renewals`` task
per bus instead looks every ``TICK_S`` at the leases whose renewal is due, in the order
they were taken, and renews each in a task of its own (a slow renewal delays no other).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import weakref
from collections.abc import Callable

from redis.exceptions import RedisError

from bus_redis import RedisBus

log = logging.getLogger(__name__)

TICK_S = 0.05  # how late a due renewal may be (against a third of the TTL, 3.3 s by default;
# a tenth of that third for short TTLs)


def _nothing() -> None:
    return None


class Lease:
    def __init__(self, bus: RedisBus, key: str, token: str, *, on_lost: Callable[[], None]) -> None:
        self.bus = bus
        self.key = key
        self.token = token
        self.lost = False
        self.active = False  # between start() and stop(): renewals are made and heeded
        self._on_lost = on_lost
        self._deadline = time.monotonic() + bus.lock_ttl_ms / 1000

    @property
    def every_s(self) -> float:
        return self.bus.lock_ttl_ms / 3000

    def start(self) -> Lease:
        self.active = True
        renewals = _renewals(self.bus)
        renewals.held.add(self)
        renewals.add(self, time.monotonic() + self.every_s)
        return self

    async def stop(self) -> None:
        """No renewal from now on; one already sent completes, and its answer is ignored
        (it is fenced by the token: it cannot extend a lease released or taken since).
        Until its due time the schedule still names this lease: it lets go of its holder."""
        self.active = False
        self._on_lost = _nothing
        _renewals(self.bus).held.discard(self)

    def holds(self) -> bool:
        """Whether the lease is still ours as far as this worker can tell: not lost, and
        its last renewal's term not over. A loop that stalled past the term (another worker
        may hold the session now) finds it over before it calls the model or a tool; the
        lease is then marked lost. Writes need no such look: they are fenced. A lease no
        longer renewed (stopped) holds until its last term ends, never longer."""
        if self.lost:
            return False
        if time.monotonic() >= self._deadline:
            if self.active:
                log.warning("lease of %s ran out while this worker stalled", self.key)
                self.mark_lost()
            return False
        return True

    def mark_lost(self) -> None:
        if not self.lost:
            self.lost = True
            self._on_lost()

    async def renew(self) -> None:
        """One due renewal (run by ``Renewals``); schedules the next while held."""
        started = time.monotonic()
        try:
            renewed = await self.bus.renew(self.key, self.token)
        except (RedisError, OSError) as exc:
            log.warning("lease renew of %s failed: %s", self.key, type(exc).__name__)
            if not self.active:
                return
            if time.monotonic() >= self._deadline:
                self.mark_lost()
            else:
                _renewals(self.bus).add(self, time.monotonic() + self.every_s)
            return
        if not self.active or self.lost:
            return
        if not renewed:
            log.warning("lease of %s lost", self.key)
            self.mark_lost()
            return
        self._deadline = started + self.bus.lock_ttl_ms / 1000
        _renewals(self.bus).add(self, started + self.every_s)


class Renewals:
    """The renewals of one bus's leases, from one task (see the module's text)."""

    def __init__(self, lock_ttl_ms: int) -> None:
        self.tick_s = min(TICK_S, lock_ttl_ms / 30_000)
        # (due, lease) in the order they were added: due times grow with it, but for a
        # renewal's own latency (a few ms against a third of the TTL)
        self._due: collections.deque[tuple[float, Lease]] = collections.deque()
        self._task: asyncio.Task[None] | None = None
        self._renewing: set[asyncio.Task[None]] = set()
        self.held: weakref.WeakSet[Lease] = weakref.WeakSet()  # started and not stopped

    def add(self, lease: Lease, due: float) -> None:
        loop = asyncio.get_running_loop()
        task = self._task
        if task is None or task.done() or task.get_loop() is not loop:
            if task is not None and task.get_loop() is not loop:
                self._due.clear()  # a former event loop's leases (tests)
            self._task = loop.create_task(self._run(), name="lease-renewals")
        self._due.append((due, lease))

    async def _run(self) -> None:
        while self._due:
            try:
                self._start_due()
            except Exception:  # a bug here must not end every lease's renewals
                log.exception("starting lease renewals failed")
            await asyncio.sleep(self.tick_s)
        self._task = None  # nothing held: the next add() starts it again

    def _start_due(self) -> None:
        now = time.monotonic()
        while self._due and self._due[0][0] <= now:
            _, lease = self._due.popleft()
            if lease.active and not lease.lost:
                task = asyncio.create_task(lease.renew(), name=f"renew:{lease.key}")
                self._renewing.add(task)
                task.add_done_callback(self._renewing.discard)


_BY_BUS: weakref.WeakKeyDictionary[RedisBus, Renewals] = weakref.WeakKeyDictionary()


def _renewals(bus: RedisBus) -> Renewals:
    found = _BY_BUS.get(bus)
    if found is None:
        found = _BY_BUS[bus] = Renewals(bus.lock_ttl_ms)
    return found


def held_tokens(bus: RedisBus) -> set[str]:
    """The lease values (``nonce|worker``) this process holds on ``bus`` now: a start's
    hand-over of its id's former leases must leave them (an in-process turn that runs as
    the loop starts; README: Embedding)."""
    return {lease.token for lease in list(_renewals(bus).held) if not lease.lost}
