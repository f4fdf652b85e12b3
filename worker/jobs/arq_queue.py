"""ArqJobQueue: jobs through arq on the same Redis, run by an arq Worker inside each
worker process (any process may run any job; arq deduplicates by job id).

arq keeps its own two connection pools: ``Worker.close()`` closes the pool it was given.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import UTC, datetime
from typing import Any

from arq import create_pool
from arq.connections import ArqRedis, RedisSettings
from arq.constants import in_progress_key_prefix
from arq.worker import Worker, func
from redis.exceptions import RedisError

from bus_redis.keys import Keys
from worker.jobs.base import JobHandler

log = logging.getLogger(__name__)
# arq fails a job for good at its timeout: above a subagent's longest run (550 s, config's
# bound) with its start and its result's publish each retried for about a minute
JOB_TIMEOUT_S = 900


class ArqJobQueue:
    def __init__(self, redis_url: str, prefix: str) -> None:
        self.settings = RedisSettings.from_dsn(redis_url)
        self.queue_name = Keys(prefix).jobs
        self.handlers: dict[str, JobHandler] = {}
        self._enqueue_pool: ArqRedis | None = None
        self._worker: Worker | None = None
        self._task: asyncio.Task[Any] | None = None

    def register(self, name: str, handler: JobHandler) -> None:
        self.handlers[name] = handler

    async def enqueue(
        self, name: str, *, job_id: str, defer_until_ms: int | None = None, **kwargs: Any
    ) -> bool:
        if self._enqueue_pool is None:
            self._enqueue_pool = await create_pool(
                self.settings, default_queue_name=self.queue_name
            )
        when = None
        if defer_until_ms is not None:
            when = datetime.fromtimestamp(defer_until_ms / 1000, UTC)
        job = await self._enqueue_pool.enqueue_job(
            name, _job_id=job_id, _defer_until=when, **kwargs
        )
        return job is not None

    async def orphaned(self, name: str, *, job_id: str, **kwargs: Any) -> None:
        """arq marks a running job in progress for its whole timeout (15 min): a job whose
        worker was killed waits that long. The mark goes, so a worker picks the job up at
        its next poll (still queued: arq drops it only once it ended); a job no longer
        queued is queued again."""
        if self._enqueue_pool is None:
            self._enqueue_pool = await create_pool(
                self.settings, default_queue_name=self.queue_name
            )
        await self._enqueue_pool.delete(in_progress_key_prefix + job_id)
        await self.enqueue(name, job_id=job_id, **kwargs)

    async def start(self) -> None:
        functions = [
            func(self._wrap(handler), name=name, keep_result=0)
            for name, handler in self.handlers.items()
        ]
        self._worker = Worker(
            functions,
            queue_name=self.queue_name,
            redis_pool=await create_pool(self.settings, default_queue_name=self.queue_name),
            handle_signals=False,
            max_jobs=32,  # subagents wait on the model most of their time
            job_timeout=JOB_TIMEOUT_S,
            poll_delay=0.2,
            log_results=False,
        )
        self._task = asyncio.create_task(self._worker.async_run(), name="arq-worker")

    @staticmethod
    def _wrap(handler: JobHandler) -> Any:
        async def job(_ctx: dict[str, Any], **kwargs: Any) -> None:
            await handler(**kwargs)

        return job

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self._worker is not None:
            # arq logs "shutdown on SIGUSR1" whenever it is closed without its own signal
            # handling: not what happened (the worker's stop is logged by the worker)
            arq_log = logging.getLogger("arq.worker")
            level = arq_log.level
            arq_log.setLevel(logging.WARNING)
            try:
                await self._worker.close()
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise  # (this task is being cancelled: not arq's)
                # arq's close gathers the job tasks it has just cancelled: one cancelled
                # while finishing raises here (seen once on a CI run): the pool still goes
                pool, self._worker._pool = self._worker._pool, None
                if pool is not None:
                    with contextlib.suppress(RedisError, OSError):
                        await pool.close(close_connection_pool=True)
            finally:
                arq_log.setLevel(level)
        if self._enqueue_pool is not None:
            await self._enqueue_pool.aclose()
