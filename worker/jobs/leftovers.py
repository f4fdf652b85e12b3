"""What a worker left running (its subagents and consolidations) runs again: a dead
worker's, judged by the liveness watch or the owners' prune; this worker's former life's,
at its start; and this worker's own entries of jobs that run nowhere here now (a former
life's left at start, or one given back after a stall), looked at every tick."""

from __future__ import annotations

import logging

from redis.exceptions import RedisError

from bus_redis.codec import safe
from worker.jobs.consolidation import Consolidator
from worker.jobs.subagents import Subagents

log = logging.getLogger(__name__)


class Leftovers:
    def __init__(self, worker_id: str, subagents: Subagents, consolidator: Consolidator) -> None:
        self.worker_id = worker_id
        self.subagents = subagents
        self.consolidator = consolidator

    async def rerun(self, worker: str, channels: set[str]) -> None:
        """What worker ``worker`` (dead, or this one's former life) left running in
        ``channels`` runs again now: its subagents and consolidations."""
        for rerun in (self.subagents.rerun_orphans, self.consolidator.rerun_orphans):
            try:
                await rerun(worker, channels)
            except RedisError as exc:  # the next look (tick, prune) tries again
                log.warning("re-running what %s left failed: %s", safe(worker), type(exc).__name__)

    async def here(self, channels: set[str]) -> None:
        """This worker's own entries of running jobs that run nowhere here now run again
        (``RunningJobs``): two ``HGETALL`` a tick."""
        await self.subagents.orphans.taken(self.worker_id, channels)
        await self.consolidator.rerun_orphans(self.worker_id, channels)
