"""The worker's garbage-collector settings (``agent-worker run`` only).

A turn allocates a few hundred containers and frees nearly all of them by reference
counting; with Python's default threshold (700 net allocations) the collector still ran a
generation-0 pass every ~10 turns, and each pass promoted what in-flight turns held into
older generations, whose passes then walked every cached session: ~100 µs of CPU per
turn on the development box, ~15 % of the worker's. With a threshold of 10,000 the same
turns need a few passes in all (``bench/baseline.py``; docs/PERFORMANCE.md). What the
worker built at start (modules, settings, clients) is frozen out of every pass.
"""

from __future__ import annotations

import gc

DEFAULT_YOUNG_THRESHOLD = 10_000


def tune(young_threshold: int) -> None:
    """Collect once, freeze what survives (never walked again), and let generation 0
    grow to ``young_threshold`` objects (0: leave Python's defaults)."""
    if young_threshold <= 0:
        return
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(young_threshold, older, oldest)
