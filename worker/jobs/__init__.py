"""Background jobs behind a thin interface: ``LocalJobQueue`` (in-process asyncio tasks)
and ``ArqJobQueue`` (arq on the same Redis, what ``agent-worker run`` uses)."""

from worker.jobs.base import JobHandler, JobQueue
from worker.jobs.local import LocalJobQueue

__all__ = ["JobHandler", "JobQueue", "LocalJobQueue"]
