"""Admin subcommands: ``status``, ``sessions``, ``memory``, ``dlq``."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from bus_redis import FrontendClient, Keys
from bus_redis.codec import fields, text
from bus_redis.streams import WORKER_GROUP
from session_store import MemoryStore, RedisSessionStore, SessionManager
from worker.app import make_redis
from worker.settings import Settings


def register(sub: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser("status", help="workers seen, queue length, pending entries, active leases")
    common(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=status)

    p = sub.add_parser("sessions", help="list | show KEY | delete KEY")
    common(p)
    p.add_argument("action", choices=["list", "show", "delete"])
    p.add_argument("key", nargs="?")
    p.set_defaults(handler=sessions)

    p = sub.add_parser("memory", help="show | set TEXT (the durable long-term memory)")
    common(p)
    p.add_argument("action", choices=["show", "set"])
    p.add_argument("text", nargs="?")
    p.set_defaults(handler=memory)

    p = sub.add_parser("dlq", help="dead letters: list | show ID | replay ID | purge")
    common(p)
    p.add_argument("action", choices=["list", "show", "replay", "purge"])
    p.add_argument("entry_id", nargs="?")
    p.set_defaults(handler=dlq)


async def collect_status(redis: aioredis.Redis, keys: Keys) -> dict[str, Any]:
    now_ms = int(time.time() * 1000)
    workers = []
    for worker_id, seen in await redis.zrange(keys.workers, 0, -1, withscores=True):
        info = await redis.hgetall(keys.worker_info(worker_id))  # type: ignore[misc]
        alive = bool(info)
        workers.append(
            {"id": worker_id, "last_seen_ms_ago": now_ms - int(seen), "alive": alive, **info}
        )
    try:
        pending = await redis.xpending(keys.ready, WORKER_GROUP)
        pending_count = int(pending["pending"])
    except ResponseError:
        pending_count = 0
    leases = [
        {"session": k, "expires_in_ms": int(score) - now_ms}
        for k, score in await redis.zrange(keys.leases, 0, -1, withscores=True)
    ]
    return {
        "redis": "up",
        "workers": workers,
        "ready_queue": await redis.xlen(keys.ready),
        "pending_unacked": pending_count,
        "active_leases": leases,
        "transient_sessions": await redis.zcard(keys.owners),
        "dead_letters": await redis.xlen(keys.dead),
        "durable_sessions": await redis.zcard(keys.sessions_index),
    }


async def status(args: argparse.Namespace, settings: Settings) -> int:
    redis = make_redis(settings.redis_url)
    try:
        try:
            await redis.ping()
        except Exception as exc:
            print(f"redis: DOWN ({settings.redis_url.split('@')[-1]}: {exc})")
            return 1
        report = await collect_status(redis, Keys(settings.key_prefix))
    finally:
        await redis.aclose()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"redis: up   ready queue: {report['ready_queue']}   unacked: {report['pending_unacked']}   "
        f"dead letters: {report['dead_letters']}"
    )
    print(
        f"durable sessions: {report['durable_sessions']}   transient sessions: {report['transient_sessions']}"
    )
    print(f"workers ({len(report['workers'])}):")
    for w in report["workers"]:
        state = "alive" if w["alive"] else "gone"
        print(
            f"  {w['id']}  {state}  seen {w['last_seen_ms_ago']} ms ago  active turns {w.get('active', '-')}"
            f"  leases lost {w.get('leases_lost', 0)}  fenced writes rejected {w.get('fenced_writes_rejected', 0)}"
        )
    print(f"active leases ({len(report['active_leases'])}):")
    for lease in report["active_leases"]:
        print(f"  {lease['session']}  expires in {lease['expires_in_ms']} ms")
    return 0


async def sessions(args: argparse.Namespace, settings: Settings) -> int:
    redis = make_redis(settings.redis_url)
    manager = SessionManager(RedisSessionStore(redis, Keys(settings.key_prefix)))
    try:
        if args.action == "list":
            for info in await manager.list_sessions():
                print(f"{info['key']}\t{info['messages']} messages\tupdated {info['updated_at']}")
            return 0
        if not args.key:
            print("agent-worker: sessions show/delete need a KEY")
            return 2
        if args.action == "show":
            payload = await manager.read_session(args.key)
            if payload is None:
                print(f"no stored session {args.key!r}")
                return 1
            print(json.dumps(payload, indent=2, ensure_ascii=False))
            return 0
        deleted = await manager.delete_session(args.key)
        print("deleted" if deleted else f"no stored session {args.key!r}")
        return 0 if deleted else 1
    finally:
        await redis.aclose()


async def memory(args: argparse.Namespace, settings: Settings) -> int:
    redis = make_redis(settings.redis_url)
    store = MemoryStore(redis, Keys(settings.key_prefix))
    try:
        if args.action == "show":
            print(await store.read_memory())
        else:
            version = await store.write_memory(args.text or "")
            print(f"memory set (version {version})")
        return 0
    finally:
        await redis.aclose()


async def dlq(args: argparse.Namespace, settings: Settings) -> int:
    redis = make_redis(settings.redis_url)
    keys = Keys(settings.key_prefix)
    try:
        if args.action == "list":
            for entry_id, raw in await redis.xrange(keys.dead):
                doc = json.loads(fields(raw).get("entry", "{}"))
                print(
                    f"{entry_id}\t{doc.get('session')}\t{doc.get('deliveries')}x\t{doc.get('reason')}"
                )
            return 0
        if args.action == "purge":
            count = await redis.xlen(keys.dead)
            await redis.delete(keys.dead)
            print(f"purged {count} dead letters")
            return 0
        if not args.entry_id:
            print("agent-worker: dlq show/replay need an ENTRY_ID")
            return 2
        found = await redis.xrange(keys.dead, args.entry_id, args.entry_id)
        if not found:
            print(f"no dead letter {args.entry_id}")
            return 1
        doc = json.loads(fields(found[0][1]).get("entry", "{}"))
        if args.action == "show":
            print(json.dumps(doc, indent=2, ensure_ascii=False))
            return 0
        client = FrontendClient(redis, settings.key_prefix)
        new_id = await client.send_raw(text(doc.get("session")), text(doc.get("payload")))
        await redis.xdel(keys.dead, args.entry_id)
        print(f"replayed as {new_id}")
        return 0
    finally:
        await redis.aclose()
