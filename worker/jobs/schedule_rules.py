"""What a schedule is: the ``cron`` tool's arguments checked and read into a
:class:`Schedule`, and its times (``at``, ``every_seconds``, a ``cron_expr`` in an IANA
zone, read by ``cronsim``). No Redis here: ``worker.jobs.schedules`` stores and fires."""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from datetime import UTC, datetime, timedelta
from typing import Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError
from pydantic import BaseModel

from bus_redis.keys import channel_of

MAX_MESSAGE_CHARS = 2000
MAX_EVERY_S = 366 * 86_400
MAX_AHEAD_MS = MAX_EVERY_S * 1000  # an `at` this far ahead at most


class ScheduleError(ValueError):
    """A schedule the tool refuses (the message is the model's to read)."""


class Schedule(BaseModel):
    id: str
    session: str  # the session key of the stream its firings go to
    key: str = ""  # the session's effective key (unified mode folds it): its hash and lease
    channel: str
    chat_id: str
    message: str
    kind: Literal["at", "every", "cron"]
    at_ms: int | None = None
    every_s: int | None = None
    cron_expr: str | None = None
    tz: str = "UTC"
    created_ms: int
    origin: str = ""  # the stream entry whose turn added it (its firings say so: "from")
    anchor_ms: int | None = None  # `every`: its first firing, which its times keep step with

    def first_due(self, now_ms: int) -> int:
        if self.kind == "at":
            return int(self.at_ms or now_ms)
        if self.kind == "every":
            return now_ms + int(self.every_s or 1) * 1000
        return cron_after(str(self.cron_expr), self.tz, now_ms)

    def next_due(self, due_ms: int, now_ms: int) -> int | None:
        """The firing after ``due_ms``, coalescing missed ones: the first after now."""
        if self.kind == "at":
            return None
        if self.kind == "every":  # in step with its first firing (a firing put off, or
            step = int(self.every_s or 1) * 1000  # late, moves none after it)
            base = due_ms if self.anchor_ms is None else min(self.anchor_ms, due_ms)
            return base + ((max(now_ms, due_ms) - base) // step + 1) * step
        return cron_after(str(self.cron_expr), self.tz, max(now_ms, due_ms))

    def named_due(self, due_ms: int) -> int:
        """The time the firing at ``due_ms`` names as due: its own, or, for a firing put
        off (moved later in the due index while it could not be delivered), the
        schedule's last time at or before it (an `every` stored before its anchor was kept
        knows none: ``due_ms``)."""
        if self.kind == "at":
            return int(self.at_ms or due_ms)
        if self.kind == "every":
            if self.anchor_ms is None or due_ms < self.anchor_ms:
                return due_ms
            step = int(self.every_s or 1) * 1000
            return self.anchor_ms + (due_ms - self.anchor_ms) // step * step
        return cron_at_or_before(str(self.cron_expr), self.tz, due_ms)

    def describe(self) -> str:
        if self.kind == "at":
            return "once"
        if self.kind == "every":
            return f"every {self.every_s} s"
        return f"cron '{self.cron_expr}' ({self.tz})"


def cron_after(expr: str, tz: str, after_ms: int) -> int:
    """The first time of ``expr`` strictly after ``after_ms``: in the hour a zone repeats
    (clocks going back) the iterator can name a wall time whose instant lies before its
    start, so it is stepped on until it does not."""
    it = CronSim(expr, datetime.fromtimestamp(after_ms / 1000, ZoneInfo(tz)))
    for _ in range(64):
        nxt = int(next(it).timestamp() * 1000)
        if nxt > after_ms:
            return nxt
    raise ValueError(f"cron expression {expr!r} names no time after {after_ms}")


def cron_at_or_before(expr: str, tz: str, ms: int) -> int:
    """The last time of ``expr`` at or before ``ms`` (``ms`` when none is found: a time
    the zone skipped, say)."""
    with contextlib.suppress(StopIteration, CronSimError, ValueError):
        it = CronSim(expr, datetime.fromtimestamp((ms + 1) / 1000, ZoneInfo(tz)), reverse=True)
        for _ in range(64):
            at = int(next(it).timestamp() * 1000)
            if at <= ms:
                return at
    return ms


def now_ms() -> int:
    return int(time.time() * 1000)


def iso(ms: int, tz: str = "UTC") -> str:
    return datetime.fromtimestamp(ms / 1000, ZoneInfo(tz)).isoformat(timespec="seconds")


def parse_schedule(
    args: dict[str, Any], *, sid: str, session: str, chat_id: str, min_every_s: int, now: int
) -> Schedule:
    """The schedule the model asked for, or ``ScheduleError`` saying what is wrong."""
    message = args.get("message")
    if not isinstance(message, str) or not message.strip():
        raise ScheduleError("add needs a non-empty 'message' (what the scheduled turn is about)")
    if len(message) > MAX_MESSAGE_CHARS:
        raise ScheduleError(f"'message' is longer than {MAX_MESSAGE_CHARS} characters")
    tz = args.get("tz") or "UTC"
    try:
        zone = ZoneInfo(str(tz))
    except (ZoneInfoNotFoundError, ValueError):
        raise ScheduleError(
            f"unknown time zone {tz!r} (use an IANA name such as Europe/Berlin)"
        ) from None
    given = [k for k in ("at", "every_seconds", "cron_expr") if args.get(k) not in (None, "")]
    if len(given) != 1:
        raise ScheduleError("give exactly one of 'at', 'every_seconds', 'cron_expr'")
    base: dict[str, Any] = {"id": sid, "session": session, "channel": channel_of(session)}
    base["chat_id"] = chat_id
    base |= {"message": message.strip(), "tz": str(tz), "created_ms": now}
    if given[0] == "at":
        return Schedule(kind="at", at_ms=_at(str(args["at"]), zone, str(tz), now), **base)
    if given[0] == "every_seconds":
        return Schedule(kind="every", every_s=_every(args["every_seconds"], min_every_s), **base)
    expr = str(args["cron_expr"])
    try:
        if len(expr.split()) != 5:  # (cronsim also reads a sixth field: seconds)
            raise ValueError(expr)
        cron_after(expr, str(tz), now)  # (it names a time to come)
        gap = closest_firings(expr)
    except (CronSimError, ValueError, StopIteration):
        raise ScheduleError(
            f"'cron_expr' {expr!r} is not a cron expression (5 fields: minute hour day month "
            "weekday)"
        ) from None
    if gap < min_every_s * 1000:
        raise ScheduleError(
            f"'cron_expr' {expr!r} fires {gap // 1000} s apart; at least {min_every_s} s apart"
        )
    return Schedule(kind="cron", cron_expr=expr, **base)


def closest_firings(expr: str) -> int:
    """The shortest time (ms) between two firings of ``expr`` in a day, or across a
    midnight (taken as possible: most expressions fire on consecutive days). A day's
    times are the same every day it fires: its minute and hour fields, at most 1,440."""
    minute, hour = expr.split()[:2]
    day = datetime(2000, 1, 1, tzinfo=UTC)
    times: list[int] = []  # minutes after midnight
    for at in CronSim(f"{minute} {hour} * * *", day - timedelta(minutes=1)):
        if at.date() != day.date():
            break
        times.append(at.hour * 60 + at.minute)
    gaps = [b - a for a, b in itertools.pairwise(times)] + [times[0] + 1440 - times[-1]]
    return min(gaps) * 60_000


def _at(text: str, zone: ZoneInfo, tz: str, now: int) -> int:
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise ScheduleError("'at' must be an ISO 8601 time, e.g. 2026-12-24T18:00") from None
    when = when if when.tzinfo else when.replace(tzinfo=zone)
    at_ms = int(when.timestamp() * 1000)
    if at_ms < now - 1000:
        try:
            shown = iso(at_ms, tz)
        except (ValueError, OverflowError, OSError):  # (year 1 with an offset: year 0)
            shown = text
        raise ScheduleError(f"'at' is in the past ({shown})")
    if at_ms > now + MAX_AHEAD_MS:
        raise ScheduleError("'at' is more than 366 days ahead")
    return at_ms


def _every(every: Any, min_every_s: int) -> int:
    if (
        isinstance(every, bool)
        or not isinstance(every, int | float)
        or not math.isfinite(every)
        or every != int(every)
    ):
        raise ScheduleError("'every_seconds' must be a whole number of seconds")
    if not min_every_s <= int(every) <= MAX_EVERY_S:
        raise ScheduleError(f"'every_seconds' must be between {min_every_s} and {MAX_EVERY_S}")
    return int(every)
