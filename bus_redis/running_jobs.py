"""The background jobs a worker runs now, so that a survivor can run them again at once.

A job queue marks a job in progress for its whole timeout (arq: 15 minutes): a job whose
worker was killed waits that long. While a job runs, its worker keeps it in its own hash
(``Keys.worker_jobs``); a worker that judges it dead claims each entry (``HDEL``: one
claimant wins) and queues the job again. Bounded by the jobs one worker runs at once; the
hash lives at most a job's timeout past its last start. A claimant that could not queue
a job again gives its entry back (``give_back``): the next look at the dead worker (the
prune of its record) claims it again.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from bus_redis.codec import text
from bus_redis.streams import RedisBus

# how long an entry lives past its job's start: the job queue's timeout (arq: 15 minutes)
# and more; a job that ran longer is gone anyway
RUNNING_TTL_MS = 20 * 60_000


class RunningJobs:
    def __init__(self, bus: RedisBus, worker_id: str, *, ttl_ms: int, kind: str = "jobs") -> None:
        self.redis = bus.raw
        self.keys = bus.keys
        self.worker_id = worker_id
        self.ttl_ms = ttl_ms
        self.kind = kind  # which of a worker's hashes (Keys.worker_jobs)

    async def started(self, job_id: str, name: str, channel: str, kwargs: dict[str, Any]) -> None:
        """Job ``job_id`` (``name(**kwargs)``, for a session of ``channel``) runs here."""
        await self._put(self.worker_id, job_id, name, channel, kwargs)

    async def give_back(
        self, dead: str, job_id: str, name: str, channel: str, kwargs: dict[str, Any]
    ) -> None:
        """A claimed entry of worker ``dead`` back in its hash, for a later claim."""
        await self._put(dead, job_id, name, channel, kwargs)

    async def _put(
        self, worker: str, job_id: str, name: str, channel: str, kwargs: dict[str, Any]
    ) -> None:
        key = self.keys.worker_jobs(worker, self.kind)
        doc = {"name": name, "channel": channel, "kwargs": kwargs}
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, job_id, json.dumps(doc))
            pipe.pexpire(key, self.ttl_ms)
            await pipe.execute()

    async def ended(self, job_id: str) -> None:
        await self.redis.hdel(self.keys.worker_jobs(self.worker_id, self.kind), job_id)  # type: ignore[misc]

    async def claim(
        self, dead: str, channels: Iterable[str], *, name: str | None = None
    ) -> list[tuple[str, str, dict[str, Any]]]:
        """``(job id, name, arguments)`` of each job worker ``dead`` ran for a session of
        ``channels`` (of job ``name`` only, when given) that this caller claimed (no other
        caller claims it too); the others stay for a worker that serves their channel (or
        claims their name). An unreadable entry goes."""
        key, served = self.keys.worker_jobs(dead, self.kind), set(channels)
        claimed: list[tuple[str, str, dict[str, Any]]] = []
        for job_id, raw in (await self.redis.hgetall(key)).items():  # type: ignore[misc]
            try:
                doc = json.loads(text(raw))
                job = (text(job_id), str(doc["name"]), dict(doc["kwargs"]))
                channel = str(doc["channel"])
            except (ValueError, KeyError, TypeError):
                job, channel = None, ""  # unreadable: dropped below
            if job is not None and (channel not in served or name not in (None, job[1])):
                continue
            if await self.redis.hdel(key, job_id) and job is not None:  # type: ignore[misc]
                claimed.append(job)  # (0: another survivor's)
        return claimed
