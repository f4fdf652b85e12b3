"""A subagent's result into the session that spawned it (``Results.publish``): published
as a frontend publishes a message, only while the subagent is still registered.

A result that meets a private session open on its session's key, or that session's
opening waiting in the stream, is not published then: it would follow the opening into
the private conversation, where it is refused (it was made by the stored one) and lost.
It is kept in its registration instead (``finished``, with the result), and a job of
its own delivers it later (``deliver``), ``PUT_OFF_S`` later and twice as late each time
it meets a private session again (``PUT_OFF_MAX_S`` at most), until the private session
has ended or the subagent was aborted (a stop, discard, delete or ``new`` of the stored
session unregisters it, as it does a running one). Its registration keeps its slot
meanwhile: a stored session waits for the result as for a running subagent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from redis.exceptions import RedisError

from bus_redis.codec import safe
from bus_redis.subagents import SubagentStore
from worker.runtime.context import Runtime

log = logging.getLogger(__name__)
FINISH_ATTEMPTS = 7  # starting a subagent, publishing its result: tried for about a minute
PUT_OFF_S = 10.0  # a result put off for a private session is tried again this much later,
PUT_OFF_MAX_S = 80.0  # twice as late each time it is put off again, at most this
T = TypeVar("T")


class Results:
    def __init__(
        self, rt: Runtime, store: SubagentStore, job: str, job_id: Callable[[str], str]
    ) -> None:
        self.rt = rt
        self.store = store
        self.job = job  # the subagent job's name: it delivers a result put off too
        self.job_id = job_id

    async def publish(self, session: str, sid: str, payload: str, run: str = "") -> None:
        """The result into the session's stream (by ``run`` only, when given); Redis
        refusing it (full) is tried again for about a minute, then the registration is
        dropped (its slots freed). Put off while a private session holds the key."""
        what = f"result of subagent {sid}"
        try:
            done = await retried(what, lambda: self.store.finish(session, sid, payload, run=run))
            if done == 1:
                log.info("subagent %s of %s ended", sid, safe(session))
            elif done == -3:
                await self._put_off(session, sid, payload, run)
            return
        except RedisError:
            log.error("result of subagent %s of %s lost: Redis kept refusing it", sid,
                      safe(session))  # fmt: skip
        with contextlib.suppress(RedisError):
            await self.store.drop(session, sid, run=run)

    async def deliver(self, session: str, sid: str, spec: dict[str, Any]) -> None:
        """A result put off before (``spec`` is its ``finished`` registration)."""
        run = spec.get("run")
        await self.publish(
            session, sid, str(spec.get("result") or ""), run if isinstance(run, str) else ""
        )

    async def _put_off(self, session: str, sid: str, payload: str, run: str) -> None:
        what = f"result of subagent {sid} put off"
        times = await retried(
            what, lambda: self.store.put_off(session, sid, payload, run, worker=self.rt.worker_id)
        )
        if not times:
            return  # aborted meanwhile (or taken by another run)
        delay_s = min(PUT_OFF_S * 2 ** (times - 1), PUT_OFF_MAX_S)
        base = self.job_id(sid)
        ids = [base + ("" if times % 2 == 0 else ":again")]  # (usually not its own)
        ids.append(base if ids[0] != base else base + ":again")
        ids.append(f"{base}:{times}")  # both taken: by two deliveries running at once
        when = int((time.time() + delay_s) * 1000)
        log.info("result of subagent %s of %s put off %.0f s: a private session holds the key",
                 sid, safe(session), delay_s)  # fmt: skip
        for job_id in ids:
            # the other id when that one is taken: by the job running this (a survivor
            # queues a dead worker's delivery under the base id, whatever its count); both
            # taken, one is queued already or both run now (each got its own count from
            # put_off, so the third id is this one's alone: at most one job a delivery)
            queued = await retried(
                what,
                lambda job_id=job_id: self.rt.jobs.enqueue(  # type: ignore[misc]
                    self.job, job_id=job_id, defer_until_ms=when, session=session, sid=sid
                ),
            )
            if queued:
                return


async def retried(what: str, op: Callable[[], Awaitable[T]]) -> T:
    """``op()``, tried again while Redis refuses it (full, a blip), about a minute in all
    (``FINISH_ATTEMPTS``); then its last error is raised."""
    for attempt in range(FINISH_ATTEMPTS - 1):
        try:
            return await op()
        except RedisError as exc:
            log.warning("%s refused (%s); trying again", what, type(exc).__name__)
            await asyncio.sleep(min(2**attempt, 16))
    return await op()
