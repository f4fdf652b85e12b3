"""Test-only fault points.

``AGENT_FAULT_POINTS=after_read,before_commit`` makes the process die at once
(``os._exit(137)``, as under kill -9) the first time it reaches one of those points;
``stall:before_model`` blocks the whole event loop for ``AGENT_FAULT_STALL_S`` (2 s) the
first time a turn is about to call the model (a live but slow worker). Unset in
production; the failover tests use them to hit an exact step.
"""

from __future__ import annotations

import os
import time

_POINTS = frozenset(p for p in os.environ.get("AGENT_FAULT_POINTS", "").split(",") if p)
KNOWN = (
    "after_read",
    "after_acquire",
    "tool_ran",  # a tool call ran, its result is not journaled yet
    "tool_recorded",  # its result is journaled, the turn is not committed
    "before_commit",
    "after_commit",
    "stall:before_model",
)
_stalled: set[str] = set()


def crash_point(name: str) -> None:
    if name in _POINTS:
        os._exit(137)


def stall_point(name: str) -> None:
    if f"stall:{name}" in _POINTS and name not in _stalled:
        _stalled.add(name)
        time.sleep(float(os.environ.get("AGENT_FAULT_STALL_S", "2")))  # the loop, blocked
