"""The background-job interface: the worker depends on this, not on arq."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

JobHandler = Callable[..., Awaitable[Any]]


class JobQueue(Protocol):
    """Runs named jobs in the background, at most one queued or running per ``job_id``."""

    def register(self, name: str, handler: JobHandler) -> None:
        """Make ``name`` runnable (before :meth:`start`)."""
        ...

    async def enqueue(
        self, name: str, *, job_id: str, defer_until_ms: int | None = None, **kwargs: Any
    ) -> bool:
        """Queue a job (to run at ``defer_until_ms``, epoch ms, when given); False when a
        job with this id is already queued or running."""
        ...

    async def orphaned(self, name: str, *, job_id: str, **kwargs: Any) -> None:
        """A job whose runner died mid-run (another worker judged it dead): run it again
        soon, not once a timeout of the queue's ran out."""
        ...

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...
