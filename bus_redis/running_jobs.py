"""The background jobs a worker runs now, so that a survivor can run them again at once.

A job queue marks a job in progress for its whole timeout (arq: 15 minutes): a job whose
worker was killed waits that long. While a job runs, its worker keeps it in its own hash
(``Keys.worker_jobs``); a worker that judges it dead claims each entry (``HDEL``: one
claimant wins) and queues the job again. Bounded by the jobs one worker runs at once; the
hash lives at most a job's timeout past its last start. A claimant that could not queue
a job again gives its entry back (``give_back``): the next look at the dead worker (the
prune of its record) claims it again.

A worker also claims from its own hash, on every maintenance tick, each entry of a job
not running in this process (``claim(own id)``): a former life's job whose queueing
failed at start, or an entry a survivor gave back after this worker, only stalled, woke
and ended the job. Either would otherwise wait out the queue's mark (or stay for good).
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
        # the jobs running in this process: id -> (name, channel, arguments)
        self.here: dict[str, tuple[str, str, dict[str, Any]]] = {}

    async def started(self, job_id: str, name: str, channel: str, kwargs: dict[str, Any]) -> int:
        """Job ``job_id`` (``name(**kwargs)``, for a session of ``channel``) runs here;
        when it started by the server's clock (microseconds)."""
        self.here[job_id] = (name, channel, kwargs)  # (before its entry: see claim)
        return await self._put(self.worker_id, job_id, name, channel, kwargs)

    async def give_back(
        self, dead: str, job_id: str, name: str, channel: str, kwargs: dict[str, Any]
    ) -> None:
        """A claimed entry of worker ``dead`` back in its hash, for a later claim."""
        await self._put(dead, job_id, name, channel, kwargs)

    async def _put(
        self, worker: str, job_id: str, name: str, channel: str, kwargs: dict[str, Any]
    ) -> int:
        key = self.keys.worker_jobs(worker, self.kind)
        doc = {"name": name, "channel": channel, "kwargs": kwargs}
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, job_id, json.dumps(doc))
            pipe.pexpire(key, self.ttl_ms)
            pipe.time()
            *_, (seconds, micros) = await pipe.execute()
        return int(seconds) * 1_000_000 + int(micros)

    async def ended(self, job_id: str) -> None:
        try:
            await self.redis.hdel(self.keys.worker_jobs(self.worker_id, self.kind), job_id)  # type: ignore[misc]
        finally:
            self.here.pop(job_id, None)  # (after its entry: see claim)

    async def claim(
        self, dead: str, channels: Iterable[str], *, name: str | None = None
    ) -> list[tuple[str, str, dict[str, Any]]]:
        """``(job id, name, arguments)`` of each job worker ``dead`` ran for a session of
        ``channels`` (of job ``name`` only, when given) that this caller claimed (no other
        caller claims it too); the others stay for a worker that serves their channel (or
        claims their name). An unreadable entry goes. ``dead`` may be this worker's own
        id: a job running in this process is left alone."""
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
            if self._running_here(dead, text(job_id)):
                continue
            if not await self.redis.hdel(key, job_id) or job is None:  # type: ignore[misc]
                continue  # (0: another survivor's)
            if self._running_here(dead, job[0]):  # started meanwhile: its entry back
                await self._put(dead, job[0], *self.here[job[0]])
                continue
            claimed.append(job)
        return claimed

    def _running_here(self, worker: str, job_id: str) -> bool:
        return worker == self.worker_id and job_id in self.here
