"""Subagents (the ``spawn`` tool): a task handed to an arq job that any worker may run,
with its own bounded tool set (reads of its session's scope only: no spawn, no cron, no
message, no goals) and iteration budget. Its result returns into the session that spawned
it as a ``system`` inbound message, published as a frontend publishes one, so order,
leases and scope apply, and it joins a running turn by the injection rules.

Registration (``bus_redis.subagents``): the spawning turn registers the subagent under
its lease (at most ``AGENT_SUBAGENTS_PER_SESSION`` running per session); the job runs
only while registered and publishes its result only while still registered. A stop,
discard, delete or ``new`` of the session published after the spawning message aborts
its subagents (``subagent_aborts``). Left out: a control no worker heard (pub/sub is at
most once) aborts nothing, and a worker started after the control does not know it (the
spawner's unregistration still holds). A subagent that fails (any error, its time limit)
reports that as its result.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from redis.exceptions import RedisError

from bus_redis import InboundMessage
from bus_redis.codec import safe
from bus_redis.keys import channel_of
from bus_redis.running_jobs import RUNNING_TTL_MS, RunningJobs
from bus_redis.subagents import SubagentStore
from session_store import Session
from session_store.models import SessionPolicy, now_iso
from worker.agent.prompt import ContextBuilder
from worker.agent.providers import ProviderError
from worker.agent.runner import TurnRunner, TurnState
from worker.agent.tools import ToolContext, ToolRegistry
from worker.agent.tools.base import Origin, call_sid
from worker.jobs.subagent_aborts import Aborts
from worker.jobs.subagent_orphans import Orphans, until_rerun
from worker.jobs.subagent_results import Results, retried
from worker.runtime.context import Runtime
from worker.runtime.outcomes import TurnAbortedError

log = logging.getLogger(__name__)
JOB_NAME = "subagent"
SUBAGENT_TOOLS = ("read_session", "search_sessions")  # reads within the session's scope
MAX_TASK_CHARS = 8000
# how often a running subagent's registration is looked at: a cut turn on another worker
# undoes it there (one HGET per running subagent, bounded by the slots)
WATCH_S = 2.0
IDENTITY = (
    "You are a subagent of redis-agent-worker: you work on one task for a conversation "
    "and reply with its result only, complete and self-contained. Use tools when they help "
    "and never invent tool results."
)


class Subagents:
    def __init__(self, rt: Runtime, tools: ToolRegistry) -> None:
        self.rt = rt
        self.store = SubagentStore(rt.bus)
        allowed = [n for n in SUBAGENT_TOOLS if n in tools.names]
        self.tools = tools.chosen(allow=allowed) if allowed else ToolRegistry()
        context = ContextBuilder(self.tools.names, identity=IDENTITY)
        self.runner = TurnRunner(
            rt.provider, self.tools, context, rt.model, rt.config.subagent_max_iterations
        )
        # the subagent jobs running here (their own hash: see Keys.worker_jobs)
        self.here = RunningJobs(rt.bus, rt.worker_id, ttl_ms=RUNNING_TTL_MS, kind="subagents")
        self.orphans = Orphans(rt, self.store, self.here, JOB_NAME, self._job_id)
        self.results = Results(rt, self.store, JOB_NAME, self._job_id)
        # session -> id -> (task, what it does)
        self.running: dict[str, dict[str, tuple[asyncio.Task[str], dict[str, Any]]]] = {}
        self.aborted: set[str] = set()  # ids cancelled by a control (not by shutdown)
        self.aborts = Aborts(rt, self.store, self.running, self.aborted)
        self.on_control = self.aborts.on_control
        # the result message must fit the payload limit its session's worker applies
        self.max_chars = rt.config.max_payload_bytes // 8

    # --- the tool -----------------------------------------------------------------------
    async def spawn(self, ctx: ToolContext, task: str, label: str) -> str:
        origin = ctx.origin
        if origin is None or not ctx.session.policy.persist:
            return "Error: subagents are for stored conversations only"
        if not task.strip():
            return "Error: 'task' is empty"
        sid = call_sid(ctx.call_id)
        label = (label.strip() or task.strip()).splitlines()[0][:60]
        doc = {
            "id": sid,
            "session": origin.member,
            "channel": origin.channel,
            "chat_id": origin.chat_id,
            "scope": ctx.session.scope,
            "label": label,
            "task": task[:MAX_TASK_CHARS],
            "state": "queued",
            "by": self.rt.worker_id,  # queues its job (a survivor does, should it die first)
            "created_ms": int(time.time() * 1000),
            "after": origin.entry_id,  # controls of the session after this entry abort it
        }
        cfg = self.rt.config
        limit = cfg.subagents_per_session
        added = await self.store.add(
            origin.lease_key, origin.token, origin.member, sid, json.dumps(doc), limit=limit,
            channel_limit=cfg.subagent_sessions_per_channel, scope=ctx.session.share_owner,
            scope_limit=cfg.subagent_sessions_per_scope,
        )  # fmt: skip
        if added == -1:
            raise TurnAbortedError("lease_lost")
        if added == -2:
            return "Error: too many subagents are running in this service; try again later"
        if added == -3:
            return (
                f"Error: subagents are running in {cfg.subagent_sessions_per_scope} of this "
                "user's conversations; wait for one to finish"
            )
        if added == 0:
            return f"Error: {limit} subagents of this conversation are running; wait for one"
        self.aborts.remember(origin.member)
        # a cut turn that does not keep this call (a discard; an interrupt or stop that
        # drops its tool round) takes the subagent with it, as it takes a schedule
        fence = (origin.lease_key or origin.member, origin.token)
        ctx.undo.append((ctx.round, self.undo_spawn(origin, ctx.call_id)))
        try:
            await self.rt.jobs.enqueue(
                JOB_NAME, job_id=self._job_id(sid), session=origin.member, sid=sid
            )
        except Exception:  # not queued: no job would ever run it, nor free its slot
            with contextlib.suppress(RedisError):
                await self.store.drop(origin.member, sid, lease_key=fence[0], token=fence[1])
            raise
        return (
            f"Subagent {sid} ({label}) started; its result will arrive in this conversation "
            "as a system message. Do not wait for it in this turn."
        )

    # --- the job ------------------------------------------------------------------------
    async def run_job(self, *, session: str, sid: str) -> None:
        """Run a registered subagent and publish its result (or why there is none) into
        its session. While it runs, this worker's entry of running jobs names it, from
        the job's first step: should this worker die before the registration names it
        (``running``), a survivor still runs it again at once (``rerun_orphans``)."""
        job_id = self._job_id(sid)
        kwargs = {"session": session, "sid": sid}
        began: int | None = None  # (by the server's clock: see SubagentStore.take_queued)
        with contextlib.suppress(RedisError):  # (a job not named runs all the same)
            began = await self.here.started(job_id, JOB_NAME, channel_of(session), kwargs)
        try:
            await self._run_job(session, sid, began)
        finally:
            with contextlib.suppress(RedisError):  # (it lives RUNNING_TTL_MS at most)
                await self.here.ended(job_id)

    async def _run_job(self, session: str, sid: str, began: int | None) -> None:
        """Redis refusing the start (full, a blip) is tried again for about a minute like
        the publish, and a start still refused then publishes a failure note (arq never
        runs a job that raised again). Only a registration that cannot even be read for
        that minute fails the job; it runs out with its TTL (an hour)."""
        spec = await self._registered(session, sid)
        if spec is None:
            return
        if spec.get("state") == "finished":  # put off for a private session: its result
            await self.results.deliver(session, sid, spec)
            return
        run = secrets.token_hex(8)  # this run: a survivor's re-run supersedes it
        spec |= {"state": "running", "worker": self.rt.worker_id, "run": run}
        if began is not None:
            spec["job_started_us"] = began
        spec["started_ms"] = int(time.time() * 1000)
        name = f"subagent {sid} ({spec['label']})"
        try:
            running = json.dumps(spec)
            what = f"start of subagent {sid}"
            if not await retried(what, lambda: self.store.running(session, sid, running)):
                # refused: ended, or taken from this worker (judged dead) and queued again
                # as the same job, which the queue drops once this run returns
                await until_rerun(self.store, session, sid, every_s=WATCH_S)
                return
        except RedisError as exc:
            text = f"[{name} failed: it could not start ({type(exc).__name__})]"
            await self.results.publish(session, sid, self._message(spec, text))
            return
        task = asyncio.create_task(self._work(spec), name=f"subagent:{sid}")
        self.running.setdefault(session, {})[sid] = (task, spec)
        try:
            result = await self._watched(task, session, sid, run)
            text = f"[{name} finished]\n{result[: self.max_chars]}"
        except _SupersededError:
            log.info("subagent %s of %s runs again elsewhere: this run ends", sid, safe(session))
            await until_rerun(self.store, session, sid, every_s=WATCH_S)
            return
        except TimeoutError:
            task.cancel()
            text = f"[{name} gave up: it ran out of time]"
        except asyncio.CancelledError:
            if sid in self.aborted:
                self.aborted.discard(sid)
                await self.store.drop(session, sid)
                log.info("subagent %s of %s aborted", sid, safe(session))
                return
            task.cancel()  # shutdown: arq runs the job again elsewhere
            raise
        except Exception as exc:
            text = (
                f"[{name} failed: {exc if isinstance(exc, ProviderError) else type(exc).__name__}]"
            )
        finally:
            self._ended(session, sid, task)
        if self.aborts.stopped_after(spec):
            await self.store.drop(session, sid)
            return
        await self.results.publish(session, sid, self._message(spec, text), run)

    async def _registered(self, session: str, sid: str) -> dict[str, Any] | None:
        """Subagent ``sid``'s registration, or None: aborted before it started (or done
        already), or by a control this worker heard (then unregistered here)."""
        docs = await retried(f"start of subagent {sid}", lambda: self.store.of_session(session))
        doc = docs.get(sid)
        if doc is None:
            return None
        spec: dict[str, Any] = json.loads(doc)
        if self.aborts.stopped_after(spec):
            await self.store.drop(session, sid)
            return None
        return spec

    async def _watched(self, task: asyncio.Task[str], session: str, sid: str, run: str) -> str:
        """``task``'s result within the subagent timeout (else TimeoutError). A subagent
        unregistered meanwhile (a cut turn undid it, maybe on another worker, which
        cannot cancel it) is cancelled as aborted: it would run on to its end for
        nothing, since its result is never published. One whose registration names
        another run (this worker stalled, was judged dead, and a survivor runs it again)
        is cancelled too (``_SupersededError``): its model calls would be paid twice."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.rt.config.subagent_timeout_s
        while (left := deadline - loop.time()) > 0:
            done, _ = await asyncio.wait({task}, timeout=min(left, WATCH_S))
            if done:
                return task.result()
            try:
                now = await self.store.run_of(session, sid)
            except RedisError:  # not known: it runs on
                now = run
            if now is None:
                self.aborted.add(sid)
                task.cancel()
                raise asyncio.CancelledError
            if now != run:
                task.cancel()
                raise _SupersededError
        raise TimeoutError

    def _ended(self, session: str, sid: str, task: asyncio.Task[str]) -> None:
        self.aborted.discard(sid)  # (an abort that came as the task ended: not needed)
        tasks = self.running.get(session, {})
        if tasks.get(sid, (None, None))[0] is task:  # (not a re-run's, started here)
            del tasks[sid]
        if not tasks:
            self.running.pop(session, None)

    async def _work(self, spec: dict[str, Any]) -> str:
        policy = SessionPolicy(persist=False, log_content=True)
        scratch = Session(key=f"subagent:{spec['id']}", scope=str(spec["scope"]), policy=policy)
        prompt = (
            f"Task (from conversation {spec['session']}; read_session with that key reads "
            f"it):\n{spec['task']}"
        )
        row = {"role": "user", "content": prompt, "timestamp": now_iso()}
        ctx = ToolContext(scratch, self.rt.sessions, emit=_nowhere)
        return await self.runner.run(scratch, row, None, ctx, TurnState())

    @staticmethod
    def _message(spec: dict[str, Any], text: str) -> str:
        member, channel, chat_id = spec["session"], spec["channel"], spec["chat_id"]
        msg = InboundMessage(
            id=f"spawn:{spec['id']}",
            channel=channel,
            chat_id=chat_id,
            session_key_override=member if member != f"{channel}:{chat_id}" else None,
            sender_id="subagent",
            input_role="system",
            content=text,
            metadata={"subagent": spec["id"], "from": str(spec.get("after") or "")},
        )
        return msg.model_dump_json(exclude_none=True)

    async def rerun_orphans(self, dead: str, channels: Iterable[str]) -> int:
        """What worker ``dead`` (judged dead) left of its subagents runs again at once
        (``subagent_orphans``); how many."""
        return await self.orphans.rerun(dead, channels)

    def _job_id(self, sid: str) -> str:
        return f"{self.rt.bus.keys.prefix}:subagent:{sid}"

    # --- a cut turn's spawn --------------------------------------------------------------
    def undo_spawn(self, origin: Origin, call_id: str) -> Callable[[], Awaitable[None]]:
        """The end of the subagent call ``call_id`` spawned (if it did), fenced by the
        lease of ``origin``'s turn."""
        fence = (origin.lease_key or origin.member, origin.token)
        sid = call_sid(call_id)
        return lambda: self._undo(origin.member, sid, fence)

    async def _undo(self, session: str, sid: str, fence: tuple[str, str]) -> None:
        """End one subagent of a cut turn: unregistered (a job that starts later finds
        nothing; one running elsewhere publishes nothing), and cancelled if it runs here.
        Only while the cut turn still holds its lease: a stalled worker's turn, taken
        over and committed by another, must not undo what that one kept."""
        lease_key, token = fence
        if not await self.store.drop(session, sid, lease_key=lease_key, token=token):
            return
        task, _ = self.running.get(session, {}).get(sid, (None, None))
        if task is not None:
            self.aborted.add(sid)
            task.cancel()


class _SupersededError(Exception):
    """The registration names another run of the subagent than this one."""


async def _nowhere(_text: str) -> None:
    return None
