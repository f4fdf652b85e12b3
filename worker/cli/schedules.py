"""``agent-worker cron``: the schedules sessions made with the ``cron`` tool, for operators."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from bus_redis import Keys, RedisBus
from bus_redis.codec import safe
from bus_redis.keys import channel_of
from bus_redis.schedules import ScheduleStore
from worker.app import make_redis
from worker.cli.admin import _channels, unknown_channel
from worker.jobs.schedule_rules import Schedule, iso
from worker.settings import Settings


def register(sub: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser(
        "cron",
        help="list | remove ID: sessions' scheduled turns",
        description="Scheduled turns that sessions added with the cron tool. list shows "
        "each schedule's id, session, rule and next firing (soonest first); remove ID "
        "deletes one (its firings stop). Deleting a session removes its schedules.",
    )
    common(p)
    p.add_argument("action", choices=["list", "remove"])
    p.add_argument("id", nargs="?", help="remove: the schedule's id")
    p.add_argument("--channel", help="only this channel's schedules")
    p.add_argument("--session", help="only this session's schedules (a session key)")
    p.add_argument("--json", action="store_true", help="list: as JSON")
    p.set_defaults(handler=cron)


async def cron(args: argparse.Namespace, settings: Settings) -> int:
    redis = make_redis(settings.redis_url)
    keys = Keys(settings.key_prefix)
    bus = RedisBus(redis, keys.prefix)
    store = ScheduleStore(bus)
    try:
        if args.session:
            channels = [channel_of(args.session)]
        elif args.channel:
            why = await unknown_channel(redis, keys, args.channel)
            if why:
                print(f"agent-worker: {why}", file=sys.stderr)
                return 2
            channels = [args.channel]
        else:
            channels = await _channels(redis, keys)
        if args.action == "remove":
            return await _remove(store, args.id, channels)
        rows = []
        for channel in channels:
            found = await (
                store.of_session(args.session) if args.session else store.all_of(channel)
            )
            rows += [(channel, sid, doc, due) for sid, doc, due in found]
        return _list(rows, args)
    finally:
        await bus.aclose()
        await redis.aclose()


def _list(rows: list[tuple[str, str, str, int | None]], args: argparse.Namespace) -> int:
    listed: list[dict[str, Any]] = []
    for _, sid, doc, due in rows:
        try:
            s = Schedule.model_validate_json(doc)
        except ValidationError:
            listed.append({"id": sid, "error": "unreadable definition"})
            continue
        nxt = iso(due, s.tz) if due is not None else None
        listed.append(
            {
                "id": sid,
                "session": s.session,
                "rule": s.describe(),
                "next": nxt,
                "message": s.message,
            }
        )
    if args.json:
        print(json.dumps(listed, indent=2))
        return 0
    for row in listed:
        if "error" in row:
            print(f"{safe(row['id'])}\t({row['error']})")
        else:  # a session key or id may hold newlines or a terminal's escapes: shown escaped
            print(
                f"{safe(row['id'])}\t{safe(row['session'], 5000)}\t{safe(row['rule'])}\t"
                f"next {row['next']}\t{row['message'][:60]!r}"
            )
    if not listed:
        where = f"session {args.session}" if args.session else (
            f"channel {args.channel}" if args.channel else "any channel")  # fmt: skip
        print(f"(no schedules in {where})")
    return 0


async def _remove(store: ScheduleStore, sid: str | None, channels: list[str]) -> int:
    if not sid:
        print("agent-worker: cron remove needs a schedule ID", file=sys.stderr)
        return 2
    for channel in channels:
        doc = await store.definition(channel, sid)
        if doc is None:
            continue
        try:
            session = Schedule.model_validate_json(doc).session
        except ValidationError:
            await store.purge(channel, sid)
            print(f"removed schedule {sid} (its definition was unreadable)")
            return 0
        await store.remove(session, sid)
        print(f"removed schedule {sid} of {session}")
        return 0
    print(f"agent-worker: no schedule {sid!r}", file=sys.stderr)
    return 1
