"""Test-only crash points.

``AGENT_FAULT_POINTS=after_read,before_commit`` makes the process die at once
(``os._exit(137)``, as under kill -9) the first time it reaches one of those points.
Unset in production; the failover tests use it to kill a worker at an exact step.
"""

from __future__ import annotations

import os

_POINTS = frozenset(p for p in os.environ.get("AGENT_FAULT_POINTS", "").split(",") if p)
KNOWN = ("after_read", "after_acquire", "before_commit", "after_commit")


def crash_point(name: str) -> None:
    if name in _POINTS:
        os._exit(137)
