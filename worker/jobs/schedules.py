"""Scheduled turns (the ``cron`` tool): a durable session's schedules fire as ``system``
inbound messages of that session, published as a frontend publishes (so order, leases and
scope apply), by whichever worker comes first, once per firing.

Kinds: one-shot ``at`` (an ISO 8601 time), ``every_seconds`` (at least
``AGENT_CRON_MIN_EVERY_S``) and ``cron_expr`` (five fields, read by ``cronsim``) in an
IANA time zone (``tz``, default UTC; daylight-saving changes follow the zone).

Delivery: a firing due within ``HORIZON_MS`` is an arq job deferred to its time, with the
id ``<prefix>:cron:<channel>:<schedule>:<firing ms>`` (any number of enqueues is one job;
a worker enqueues a firing once); every worker's maintenance tick fires what is overdue (a
job lost with a Redis restart, a worker killed before enqueueing the next) and enqueues
what comes due within the horizon. No job waits longer than the horizon, so a schedule
removed (or a session deleted) leaves at most one short-lived job behind, whatever its
rule: arq holds work in proportion to the firings of the next two minutes, not to what a
channel ever scheduled. ``lua/cron_fire.lua`` publishes the
firing and moves the schedule on in one step, only if the schedule is still due at that
firing: a firing is delivered once. The message id ``cron:<schedule>:<firing ms>`` is
deterministic, so the duplicate-id rule would collapse a second copy anyway.

Missed firings (every worker down, Redis down): a late schedule fires once when it is
noticed, and its next firing is the first one after now; the firings missed in between
are skipped, not replayed one after another. A one-shot ``at`` in the past fires once.
A firing that cannot be delivered now (the first turn of its session, which added it,
still runs; a private session is open on its key, whose conversation it must not run in)
is put off ``PUT_OFF_MS`` and moved in the due index to then, so that it never holds up
the channel's other overdue firings; it is delivered once it can be, as a late one.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from cronsim import CronSimError
from pydantic import ValidationError
from redis.exceptions import ResponseError

from bus_redis import InboundMessage
from bus_redis.codec import safe
from bus_redis.keys import channel_of
from bus_redis.schedules import ScheduleStore
from worker.agent.tools.base import Origin, ToolContext, call_sid
from worker.jobs.schedule_rules import (
    Schedule,
    ScheduleError,
    iso,
    now_ms,
    parse_schedule,
)
from worker.runtime.context import Runtime
from worker.runtime.outcomes import TurnAbortedError

log = logging.getLogger(__name__)
JOB_NAME = "cron_fire"
SWEEP_BATCH = 32  # overdue schedules a worker fires per channel and maintenance tick
ENQUEUE_BATCH = 1000  # upcoming firings a worker queues as jobs per channel and tick
PUT_OFF_MS = 10_000  # a firing that cannot be delivered now is tried again this much later
HORIZON_MS = 120_000  # firings due within this are arq jobs; later ones wait in Redis only
ENQUEUED_MEMO = 10_000  # firings this worker enqueued (not enqueued again)


class Schedules:
    """The ``cron`` tool's service, the firing job and the overdue sweep."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.store = ScheduleStore(rt.bus)
        self._enqueued: dict[tuple[str, int], None] = {}  # (schedule, firing) sent to arq

    # --- the tool -----------------------------------------------------------------------
    async def handle(self, ctx: ToolContext, action: str, args: dict[str, Any]) -> str:
        origin = ctx.origin
        if origin is None or not ctx.session.policy.persist:
            return "Error: schedules are for stored conversations only"
        if action == "add":
            return await self._add(ctx, args)
        if action == "list":
            rows = await self.store.of_session(origin.member)
            return (
                json.dumps([self._public(doc, due) for _, doc, due in rows])
                if rows
                else "No schedules"
            )
        if action == "remove":
            return await self._remove(ctx, str(args.get("id") or ""))
        return "Error: action must be add, list or remove"

    async def _remove(self, ctx: ToolContext, sid: str) -> str:
        """Remove one of the session's schedules, fenced by the turn's lease (a stalled
        worker's turn removes nothing), and undone with the turn (a discard, or a cut
        that drops this call's round): the schedule comes back as it was, its next
        firing included."""
        origin, cfg = ctx.origin, self.rt.config
        assert origin is not None
        fence = {"lease_key": origin.lease_key or origin.member, "token": origin.token}
        removed, doc, due = (
            await self.store.take(origin.member, sid, **fence) if sid else (0, "", None)
        )
        if removed == -1:
            raise TurnAbortedError("lease_lost")
        if removed != 1 or not doc:
            return f"Error: no schedule {sid!r} in this conversation"
        due = now_ms() if due is None else due  # (none: about to fire; once, now)

        async def undo() -> None:
            added = await self.store.add(
                fence["lease_key"], fence["token"], origin.member, sid, doc, due,
                limit=cfg.cron_max_per_session, channel_limit=cfg.cron_max_per_channel,
                scope=ctx.session.share_owner, scope_limit=cfg.cron_max_per_scope,
            )  # fmt: skip
            if added == 1:  # its firing job may have run meanwhile and found nothing
                self._enqueued.pop((sid, due), None)
                await self.enqueue(channel_of(origin.member), sid, due)
            elif added != 2:
                log.warning("schedule %s of a cut turn not restored (%d)", safe(sid), added)

        ctx.undo.append((ctx.round, undo))
        return f"Removed schedule {sid}"

    async def _add(self, ctx: ToolContext, args: dict[str, Any]) -> str:
        origin, cfg = ctx.origin, self.rt.config
        assert origin is not None
        sid = call_sid(ctx.call_id)
        now = now_ms()
        try:
            schedule = parse_schedule(
                args, sid=sid, session=origin.member, chat_id=origin.chat_id,
                min_every_s=cfg.cron_min_every_s, now=now,
            )  # fmt: skip
        except ScheduleError as exc:
            return f"Error: {exc}"
        schedule.key = origin.lease_key or origin.member
        schedule.origin = origin.entry_id or ""
        first = schedule.first_due(now)
        if schedule.kind == "every":
            schedule.anchor_ms = first
        added = await self.store.add(
            origin.lease_key, origin.token, origin.member, sid, schedule.model_dump_json(),
            first, limit=cfg.cron_max_per_session, channel_limit=cfg.cron_max_per_channel,
            scope=ctx.session.share_owner, scope_limit=cfg.cron_max_per_scope,
        )  # fmt: skip
        if added == -1:
            raise TurnAbortedError("lease_lost")
        if added == -2:
            return "Error: this service holds as many schedules as it may; try again later"
        if added == -3:
            return (
                f"Error: this user's conversations hold {cfg.cron_max_per_scope} schedules "
                "already; remove one first"
            )
        if added == 0:
            return f"Error: this conversation has {cfg.cron_max_per_session} schedules already; remove one first"
        if added == 1:
            ctx.undo.append((ctx.round, self.undo_add(origin, ctx.call_id)))
        await self.enqueue(schedule.channel, sid, first)
        return f"Scheduled {sid}: {schedule.describe()}, next at {iso(first, schedule.tz)}"

    def undo_add(self, origin: Origin, call_id: str) -> Callable[[], Awaitable[Any]]:
        """The removal of the schedule call ``call_id`` added (if it did), fenced by the
        lease of ``origin``'s turn."""
        fence = {"lease_key": origin.lease_key or origin.member, "token": origin.token}
        sid = call_sid(call_id)
        return lambda: self.store.remove(origin.member, sid, **fence)

    @staticmethod
    def _public(doc: str, due: int | None) -> dict[str, Any]:
        s = Schedule.model_validate_json(doc)
        return {
            "id": s.id,
            "message": s.message,
            "rule": s.describe(),
            "next": iso(due, s.tz) if due is not None else None,
        }

    # --- firing ---------------------------------------------------------------------------
    async def enqueue(self, channel: str, sid: str, due_ms: int) -> None:
        """An arq job for a firing due within the horizon (once per worker); a later one
        is left to the sweep, which enqueues it when it comes within the horizon."""
        if due_ms - now_ms() > HORIZON_MS or (sid, due_ms) in self._enqueued:
            return
        self._enqueued[(sid, due_ms)] = None
        while len(self._enqueued) > ENQUEUED_MEMO:
            self._enqueued.pop(next(iter(self._enqueued)))
        job_id = f"{self.rt.bus.keys.prefix}:cron:{channel}:{sid}:{due_ms}"
        await self.rt.jobs.enqueue(
            JOB_NAME, job_id=job_id, defer_until_ms=due_ms, channel=channel, sid=sid, due_ms=due_ms
        )

    async def fire(self, *, channel: str, sid: str, due_ms: int) -> bool:
        """The job (and the sweep): deliver the firing ``due_ms`` of schedule ``sid`` if
        it is still due then; True when this call delivered it."""
        doc = await self.store.definition(channel, sid)
        if doc is None:
            return False
        try:
            schedule = Schedule.model_validate_json(doc)
        except ValidationError:
            log.warning("schedule %s of %s is unreadable; removed", safe(sid), safe(channel))
            await self.store.purge(channel, sid)
            return False
        now = now_ms()
        if due_ms > now:  # early (another worker's clock): at its time instead
            self._enqueued.pop((sid, due_ms), None)
            await self.enqueue(channel, sid, due_ms)
            return False
        nxt = schedule.next_due(due_ms, now)
        message = self._message(schedule, due_ms)
        key = schedule.key or schedule.session
        retry = now + PUT_OFF_MS
        fired = await self.store.fire(
            schedule.session, key, sid, due_ms, message, nxt, retry_ms=retry
        )
        if fired in (1, -2) and nxt is not None:
            await self.enqueue(channel, sid, nxt)
        elif fired == -3:  # put off: tried again then (a private session may stay open
            await self.enqueue(channel, sid, max(retry, due_ms + 1))  # for hours)
        if fired == -2:
            log.warning("a firing of %s was not delivered: its stream takes no entry", safe(sid))
        return fired == 1

    @staticmethod
    def _message(s: Schedule, due_ms: int) -> str:
        """The firing at ``due_ms`` (its id, for exactly once), naming the time it was due
        (``Schedule.named_due``: a firing put off names its own time, not when it fired)."""
        member, named = s.session, s.named_due(due_ms)
        msg = InboundMessage(
            id=f"cron:{s.id}:{due_ms}",
            channel=s.channel,
            chat_id=s.chat_id,
            session_key_override=member if member != f"{s.channel}:{s.chat_id}" else None,
            sender_id="cron",
            input_role="system",
            content=f"Scheduled ({s.describe()}, due {iso(named, s.tz)}): {s.message}",
            metadata={"cron": {"id": s.id, "due_ms": named}, "from": s.origin},
        )
        return msg.model_dump_json(exclude_none=True)

    async def sweep(self, channels: set[str]) -> int:
        """Fire what is overdue (at most ``SWEEP_BATCH`` per channel and call, the most
        overdue first) and enqueue what comes due within the horizon (at most
        ``ENQUEUE_BATCH``, each once per worker). A channel's failure (its keys, a full
        Redis) is logged and skips only that channel."""
        fired, now = 0, now_ms()
        for channel in sorted(channels):
            try:
                for sid, due in await self.store.due(channel, now, limit=SWEEP_BATCH):
                    try:  # one schedule's failure (its session's keys) skips that one only
                        fired += await self.fire(channel=channel, sid=sid, due_ms=due)
                    except (
                        ResponseError,
                        ValueError,
                        KeyError,
                        CronSimError,
                    ) as exc:  # (its times)
                        log.warning("schedule %s of %s not fired: %s", safe(sid), safe(channel),
                                    safe(str(exc)))  # fmt: skip
                upcoming = await self.store.due_between(
                    channel, now, now + HORIZON_MS, limit=ENQUEUE_BATCH
                )
                for sid, due in upcoming:
                    await self.enqueue(channel, sid, due)
            except Exception as exc:  # one channel must not stop the others
                log.warning("schedules of %s not swept: %s", safe(channel), type(exc).__name__)
        return fired
