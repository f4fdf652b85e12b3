"""The worker's event loop: wake-ups coalesced when the process is not busy.

A worker wakes for each reply it waits on (a notification, an ``acquire``, a ``commit``).
When it shares the machine's cores with other busy processes (more workers than cores,
Redis, a frontend), the kernel switches to it for every single reply: each wake-up then
finds one event, reads one reply and runs cold, so the CPU spent per turn grows with the
number of processes (measured: 2.5x with 4 workers on 2 cores, see docs/PERFORMANCE.md).

:class:`LingeringSelector` waits a little longer after a wake-up that found a single
ready socket and nothing else to run: what else arrives meanwhile (more replies on the
same connection, another connection's) is handled in the same pass. It never lingers when
the loop has work waiting (``select`` called with a zero timeout: the process is busy,
its passes already batch) nor after a wake-up that found several sockets ready. The
price is latency when idle: about ``linger_s`` per wake-up, never past a timer's due
time (``AGENT_LOOP_LINGER_US``, 500 µs by default; 0 turns it off), against turns that
take a model call's time.
"""

from __future__ import annotations

import asyncio
import selectors
import time
from collections.abc import Callable
from typing import Any

DEFAULT_LINGER_US = 500


class LingeringSelector(selectors.DefaultSelector):
    """A selector that, after a wake-up with one ready socket, waits ``linger_s`` and
    adds whatever became ready meanwhile."""

    def __init__(self, linger_s: float, sleep: Callable[[float], Any] = time.sleep) -> None:
        super().__init__()
        self.linger_s = linger_s
        self._sleep = sleep

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        start = time.monotonic() if timeout is not None else 0.0
        ready: list[tuple[selectors.SelectorKey, int]] = super().select(timeout)
        if len(ready) != 1 or timeout == 0 or self.linger_s <= 0:
            return ready
        linger = self.linger_s
        if timeout is not None:  # never past a timer the loop waits for
            linger = min(linger, timeout - (time.monotonic() - start))
            if linger <= 0:
                return ready
        self._sleep(linger)
        key, events = ready[0]
        for more_key, more_events in super().select(0):
            if more_key.fd == key.fd:
                events |= more_events
            else:
                ready.append((more_key, more_events))
        ready[0] = (key, events)
        return ready


def loop_factory(linger_us: int) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """A factory for :class:`asyncio.Runner`; None (asyncio's own loop, set as the current
    one as by :func:`asyncio.run`) when ``linger_us`` is 0."""
    if linger_us <= 0:
        return None
    return lambda: asyncio.SelectorEventLoop(LingeringSelector(linger_us / 1e6))
