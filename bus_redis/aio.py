"""asyncio helpers for the frontend side, which runs on any redis-py 5..8."""

from __future__ import annotations

import asyncio


def still_wanted() -> None:
    """Re-raise a cancellation the Redis client swallowed.

    Seen with redis-py 8: a task cancelled while a command is in flight can carry on as if
    nothing happened (``Task.cancelling()`` still counts the request). A reader that loops
    over Redis calls (a client that left, a timed-out wait) would then never end. Called
    after each Redis call such a loop awaits."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
