"""``agent-worker status``: workers, queues and leases; ``--check`` as a healthcheck."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from bus_redis import Keys, RedisBus
from bus_redis.codec import server_ms, stream_id_ms, text
from bus_redis.streams import WORKER_GROUP
from bus_redis.subagents import SubagentStore
from worker.app import make_redis
from worker.cli.admin import _channels
from worker.cli.main import redact_url
from worker.settings import Settings


def register(sub: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser(
        "status",
        help="workers, queues, leases, running subagents (--check: a healthcheck)",
        description="Workers (alive while their heartbeat is younger than their lease TTL), "
        "each channel's queues, every active lease with its holder, and the subagents "
        "queued or running (with the worker running each). With --check, print "
        "one line and exit 1 when no worker is alive, or the oldest queued notification is "
        "older than --max-queue-age (a container healthcheck).",
    )
    common(p)
    p.add_argument("--json", action="store_true", help="the report as JSON (numbers as numbers)")
    p.add_argument("--check", action="store_true", help="exit 1 unless the deployment is healthy")
    p.add_argument(
        "--max-queue-age", type=float, default=60.0, metavar="S",
        help="--check: the oldest queued notification may be this old (default 60 s)",
    )  # fmt: skip
    p.set_defaults(handler=status)


DEFAULT_DEAD_AFTER_MS = 10_000  # a heartbeat record without its own TTL (older workers)


def _number(value: str) -> int | str:
    try:
        return int(value)
    except ValueError:
        return value


async def collect_status(
    redis: aioredis.Redis, keys: Keys, *, discover: bool = True
) -> dict[str, Any]:
    now_ms = await server_ms(redis)  # heartbeats are stamped with Redis's clock
    workers = []
    for worker_id, seen in await redis.zrange(keys.workers, 0, -1, withscores=True):
        info = {
            k: _number(v)
            for k, v in (await redis.hgetall(keys.worker_info(worker_id))).items()  # type: ignore[misc]
        }
        ago = now_ms - int(seen)
        dead_after = info.get("dead_after_ms", DEFAULT_DEAD_AFTER_MS)
        alive = bool(info) and ago <= (dead_after if isinstance(dead_after, int) else 0)
        workers.append({"id": worker_id, "last_seen_ms_ago": ago, "alive": alive, **info})
    per_channel = {}
    leases = []
    for channel in await _channels(redis, keys, discover=discover):
        try:
            pending = int((await redis.xpending(keys.ready(channel), WORKER_GROUP))["pending"])
        except ResponseError:
            pending = 0
        oldest = await redis.xrange(keys.ready(channel), "-", "+", count=1)
        per_channel[channel] = {
            "ready": await redis.xlen(keys.ready(channel)),
            "unacked": pending,
            "oldest_queued_ms": now_ms - stream_id_ms(text(oldest[0][0])) if oldest else 0,
            "transient_sessions": await redis.zcard(keys.owners(channel)),
            "dead_letters": await redis.xlen(keys.dead(channel)),
            "durable_sessions": await redis.zcard(keys.sessions_index(channel)),
        }
        for key in await redis.zrange(keys.leases(channel), 0, -1):
            value = text(await redis.get(keys.lease(key)))
            if value:
                holder = value.partition("|")[2]
                ttl = int(await redis.pttl(keys.lease(key)))
                leases.append({"key": key, "holder": holder, "expires_in_ms": ttl})
    subagents = await _subagents(redis, keys, list(per_channel), now_ms)
    return {
        "redis": "up",
        "workers": workers,
        "channels": per_channel,
        "active_leases": leases,
        "subagents": subagents,
    }


async def _subagents(
    redis: aioredis.Redis, keys: Keys, channels: list[str], now_ms: int, *, limit: int = 100
) -> list[dict[str, Any]]:
    """Running (and queued) subagents, at most ``limit`` sessions per channel."""
    bus = RedisBus(redis, keys.prefix)  # reads only: no script, no connection of its own
    store = SubagentStore(bus)
    found = []
    for channel in channels:
        for session in await store.sessions(channel, limit=limit):
            for sid, raw in sorted((await store.of_session(session)).items()):
                try:
                    doc = json.loads(raw)
                except ValueError:
                    continue
                started = int(doc.get("started_ms") or doc.get("created_ms") or now_ms)
                found.append({
                    "id": sid,
                    "session": session,
                    "label": doc.get("label", ""),
                    "state": doc.get("state", "queued"),
                    "worker": doc.get("worker", ""),
                    "running_for_ms": max(0, now_ms - started),
                })  # fmt: skip
    return found


def _check(report: dict[str, Any], max_queue_age_s: float) -> tuple[bool, str]:
    alive = [w for w in report["workers"] if w["alive"]]
    if not alive:
        stale = len(report["workers"])
        return False, f"unhealthy: no worker alive ({stale} with a stale heartbeat)"
    old = {
        name: c["oldest_queued_ms"]
        for name, c in report["channels"].items()
        if c["oldest_queued_ms"] > max_queue_age_s * 1000
    }
    if old:
        name, age = max(old.items(), key=lambda kv: kv[1])
        return False, f"unhealthy: channel {name} has a notification queued for {age / 1000:.0f} s"
    return True, f"healthy: {len(alive)} workers alive"


async def status(args: argparse.Namespace, settings: Settings) -> int:
    redis = make_redis(settings.redis_url)
    try:
        try:
            await redis.ping()
        except (RedisError, OSError) as exc:
            print(f"redis: DOWN ({redact_url(settings.redis_url)}: {type(exc).__name__})")
            return 1
        # --check runs every few seconds as a healthcheck: registered channels only, no SCAN
        report = await collect_status(redis, Keys(settings.key_prefix), discover=not args.check)
    finally:
        await redis.aclose()
    if args.check:
        ok, line = _check(report, args.max_queue_age)
        print(line)
        return 0 if ok else 1
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"redis: up   channels ({len(report['channels'])}):")
    for name, c in report["channels"].items():
        print(
            f"  {name}: ready {c['ready']}  unacked {c['unacked']}  oldest queued "
            f"{c['oldest_queued_ms']} ms  durable sessions {c['durable_sessions']}  "
            f"transient {c['transient_sessions']}  dead letters {c['dead_letters']}"
        )
    print(f"workers ({len(report['workers'])}):")
    for w in report["workers"]:
        state = "alive" if w["alive"] else "dead"
        print(
            f"  {w['id']}  {state}  seen {w['last_seen_ms_ago']} ms ago  active turns {w.get('active', '-')}"
            f"  leases lost {w.get('leases_lost', 0)}  fenced writes rejected {w.get('fenced_writes_rejected', 0)}"
        )
    print(f"active leases ({len(report['active_leases'])}):")
    for lease in report["active_leases"]:
        print(
            f"  {lease['key']}  held by {lease['holder']}  expires in {lease['expires_in_ms']} ms"
        )
    print(f"subagents ({len(report['subagents'])}):")
    for sub in report["subagents"]:
        where = f" on {sub['worker']}" if sub["worker"] else ""
        print(
            f"  {sub['id']}  {sub['state']}{where}  session {sub['session']}  "
            f"{sub['label']!r}  for {sub['running_for_ms']} ms"
        )
    return 0
