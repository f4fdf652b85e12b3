"""What a dead worker left of its subagents runs again at once, instead of once the job
queue's timeout (arq: 15 minutes) ran out.

Three cases, each claimed once among the survivors that judged the worker dead:

- a subagent it registered whose job it may never have queued (``queued`` by it):
  queued again (the job queue drops a second copy of a queued job id);
- a job it had taken (named in its hash of running jobs, ``RunningJobs``, the job's first
  step) whatever the registration says: ``queued`` by a live worker (it died before the
  job marked it ``running``) or ``running`` on it;
- a subagent ``running`` on it whose job it did not name (an older worker): claimed from
  the registration (``SubagentStore.claim_orphan``, ``WATCH``ed), which also ends the
  run there should the worker only have stalled;
- a result it put off for a private session (``finished``, ``subagent_results``): its
  delivery queued again, since an in-process queue's deferred job died with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Iterable

from redis.exceptions import RedisError

from bus_redis.codec import safe
from bus_redis.keys import channel_of
from bus_redis.running_jobs import RunningJobs
from bus_redis.subagents import SubagentStore
from worker.runtime.context import Runtime

log = logging.getLogger(__name__)
RERUN_WAIT_S = 120.0  # how long a superseded (or refused) run waits for the re-run to start


class Orphans:
    def __init__(
        self, rt: Runtime, store: SubagentStore, here: RunningJobs, job: str,
        job_id: Callable[[str], str],
    ) -> None:  # fmt: skip
        self.rt = rt
        self.store = store
        self.here = here  # this worker's running jobs (a dead worker's: claimed here)
        self.job = job  # the subagent job's name
        self.job_id = job_id  # a subagent id's job id

    async def rerun(self, dead: str, channels: Iterable[str]) -> int:
        """The subagents worker ``dead`` left, in sessions of ``channels``, run again;
        how many. Bounded: the sessions of a channel running subagents are at most
        ``AGENT_SUBAGENT_SESSIONS_PER_CHANNEL``, each with at most
        ``AGENT_SUBAGENTS_PER_SESSION``; the dead worker's running jobs by its job slots."""
        channels = set(channels)
        taken = await self.taken(dead, channels)
        again = len(taken)
        limit = self.rt.config.subagent_sessions_per_channel
        for channel in channels:
            for session in await self.store.sessions(channel, limit=limit):
                for sid, raw in (await self.store.of_session(session)).items():
                    # (one queued again above; else only what names the dead worker)
                    if sid not in taken and registration_state(raw)[1] == dead:
                        again += await self._again(session, sid, raw, dead)
        return again

    async def taken(self, dead: str, channels: set[str]) -> set[str]:
        """The subagent jobs worker ``dead`` had taken (its entries of running jobs that
        this caller claimed): each still registered runs again, started or not."""
        claimed = await self.here.claim(dead, channels, name=self.job)
        again: set[str] = set()
        for at, (job_id, _, kwargs) in enumerate(claimed):
            session, sid = str(kwargs.get("session")), str(kwargs.get("sid"))
            try:
                raw = (await self.store.of_session(session)).get(sid)
                if await self._again(session, sid, raw, dead, job_id):
                    again.add(sid)
            except Exception:  # the rest back in the dead worker's hash: claimed again later
                for back_id, _, back in claimed[at:]:
                    with contextlib.suppress(RedisError):
                        await self.here.give_back(
                            dead, back_id, self.job, channel_of(str(back.get("session"))), back
                        )
                raise
        return again

    async def _again(
        self, session: str, sid: str, raw: str | None, dead: str, job_id: str = ""
    ) -> bool:
        """Queue subagent ``sid`` again when it is still ``dead``'s to run: ``running`` on
        it (claimed from the registration: one survivor wins), ``queued`` (marked taken
        from it), or claimed here before and not queued then (``running`` here, no run:
        the re-queue was refused and the entry given back). Whether it was queued."""
        state, worker, run = registration_state(raw)
        me = self.rt.worker_id
        if state == "running" and worker == dead:
            if not await self.store.claim_orphan(session, sid, dead, me):
                return False  # another survivor took it
        elif state == "running" and worker == me and not run:
            pass
        elif state == "finished":
            pass  # its result put off (``subagent_results``): delivered by a job again, at
            # once (its deferred job died with an in-process queue; a second is harmless:
            # the result is published once, by ``spawn_done.lua``)
        elif state != "queued" or not await self._take(session, sid, dead):
            return False  # ended, or running again elsewhere
        await self.rt.jobs.orphaned(
            self.job, job_id=job_id or self.job_id(sid), session=session, sid=sid
        )
        return True

    async def _take(self, session: str, sid: str, dead: str) -> bool:
        """A ``queued`` registration marked as taken from ``dead`` (its start refused
        there should it only have stalled); a former life of this worker's id (at start)
        is not marked: the re-run starts under the same id."""
        if dead == self.rt.worker_id:
            return True
        return await self.store.take_queued(session, sid, dead)


def registration_state(raw: str | None) -> tuple[str, str | None, str]:
    """A registration's state, its worker (the registering one while ``queued``, the
    running one once ``running``) and its run ('' when none); ``("", None, "")`` when
    gone or unreadable."""
    try:
        doc = json.loads(raw) if raw is not None else None
    except ValueError:
        return "", None, ""
    if not isinstance(doc, dict):
        return "", None, ""
    state, run = doc.get("state"), doc.get("run")
    worker = doc.get("by" if state == "queued" else "worker")
    return (
        state if isinstance(state, str) else "",
        worker if isinstance(worker, str) else None,
        run if isinstance(run, str) else "",
    )


async def until_rerun(store: SubagentStore, session: str, sid: str, *, every_s: float) -> None:
    """A superseded run (or one whose start was refused: taken from its worker) ends only
    once the re-run started (the registration names a run again) or the subagent ended,
    ``RERUN_WAIT_S`` at most: the job queue drops a job whose run returns, and the
    survivor's re-run is the same job, queued again and maybe not taken yet."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + RERUN_WAIT_S
    while loop.time() < deadline:
        try:
            if await store.run_of(session, sid) != "":
                return
        except RedisError:
            pass
        await asyncio.sleep(every_s)
    log.warning("subagent %s of %s: its re-run did not start", sid, safe(session))
