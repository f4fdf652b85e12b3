"""LocalJobQueue: jobs as asyncio tasks of this process (embedding, tests on fakeredis)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from worker.jobs.base import JobHandler

log = logging.getLogger(__name__)


class LocalJobQueue:
    def __init__(self) -> None:
        self.handlers: dict[str, JobHandler] = {}
        self._running: dict[str, asyncio.Task[Any]] = {}
        self._waiting: set[str] = set()  # deferred jobs not due yet

    def register(self, name: str, handler: JobHandler) -> None:
        self.handlers[name] = handler

    async def enqueue(
        self, name: str, *, job_id: str, defer_until_ms: int | None = None, **kwargs: Any
    ) -> bool:
        if job_id in self._running:
            return False
        delay = 0.0 if defer_until_ms is None else max(0.0, defer_until_ms / 1000 - time.time())
        if delay:
            self._waiting.add(job_id)
        task = asyncio.create_task(self._run(job_id, name, kwargs, delay), name=f"job:{job_id}")
        self._running[job_id] = task
        task.add_done_callback(lambda _t: self._done(job_id))
        return True

    def _done(self, job_id: str) -> None:
        self._running.pop(job_id, None)
        self._waiting.discard(job_id)

    async def _run(self, job_id: str, name: str, kwargs: dict[str, Any], delay: float) -> None:
        if delay:
            await asyncio.sleep(delay)  # a deferred job (a schedule's firing)
            self._waiting.discard(job_id)
        try:
            await self.handlers[name](**kwargs)
        except Exception:
            log.exception("job %s failed", name)

    async def orphaned(self, name: str, *, job_id: str, **kwargs: Any) -> None:
        await self.enqueue(name, job_id=job_id, **kwargs)  # (another process's: run here)

    async def start(self) -> None:
        return None

    async def aclose(self) -> None:
        """Wait for running jobs (5 s at most); deferred ones not due yet are dropped
        (the schedules' sweep fires them when they are overdue)."""
        for job_id in self._waiting:
            self._running[job_id].cancel()
        if self._running:
            await asyncio.wait(set(self._running.values()), timeout=5)
