"""LocalJobQueue: jobs as asyncio tasks of this process (embedding, tests on fakeredis)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from worker.jobs.base import JobHandler

log = logging.getLogger(__name__)


class LocalJobQueue:
    def __init__(self) -> None:
        self.handlers: dict[str, JobHandler] = {}
        self._running: dict[str, asyncio.Task[Any]] = {}

    def register(self, name: str, handler: JobHandler) -> None:
        self.handlers[name] = handler

    async def enqueue(self, name: str, *, job_id: str, **kwargs: Any) -> bool:
        if job_id in self._running:
            return False
        task = asyncio.create_task(self._run(name, kwargs), name=f"job:{job_id}")
        self._running[job_id] = task
        task.add_done_callback(lambda _t: self._running.pop(job_id, None))
        return True

    async def _run(self, name: str, kwargs: dict[str, Any]) -> None:
        try:
            await self.handlers[name](**kwargs)
        except Exception:
            log.exception("job %s failed", name)

    async def start(self) -> None:
        return None

    async def aclose(self) -> None:
        if self._running:
            await asyncio.wait(set(self._running.values()), timeout=5)
