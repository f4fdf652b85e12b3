"""Admin subcommands: ``sessions``, ``memory``, ``dlq``, ``channels`` (``status`` is in
``worker.cli.status``)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis

from bus_redis import FrontendClient, Keys, RedisBus
from bus_redis.codec import fields, text
from bus_redis.keys import glob_escape, valid_channel
from bus_redis.registry import Registry
from session_store import OWNER_SCOPE, MemoryStore, RedisSessionStore, SessionManager
from worker.app import make_redis
from worker.settings import Settings


def register(sub: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser(
        "sessions",
        help="list | show KEY | delete KEY | prune --older-than AGE (delete waits for the lease)",
        description="Stored (durable) sessions. prune deletes those not updated for AGE "
        "(e.g. 30d, 12h, 90m, 600s) with their indexes and events, as workers do by "
        "themselves after AGENT_SESSION_TTL_S; a session with a running turn, queued "
        "messages or schedules is left alone.",
    )
    common(p)
    p.add_argument("action", choices=["list", "show", "delete", "prune"])
    p.add_argument("key", nargs="?")
    p.add_argument("--scope", help="list: only this scope's sessions (CHANNEL/NAME)")
    p.add_argument("--older-than", type=_age, metavar="AGE", help="prune: idle at least this long")
    p.set_defaults(handler=sessions)

    p = sub.add_parser("memory", help="show | set TEXT | clear: one scope's long-term memory")
    common(p)
    p.add_argument("action", choices=["show", "set", "clear"])
    p.add_argument("text", nargs="?")
    p.add_argument(
        "--scope",
        help=f"CHANNEL/NAME (default {OWNER_SCOPE}, the one memory of single-owner and unified "
        "modes; needed in per-session mode)",
    )
    p.set_defaults(handler=memory)

    p = sub.add_parser("dlq", help="dead letters: list | show ID | replay ID | purge")
    common(p)
    p.add_argument("action", choices=["list", "show", "replay", "purge"])
    p.add_argument("entry_id", nargs="?")
    p.add_argument("--channel", help="only this channel's dead letters")
    p.set_defaults(handler=dlq)

    p = sub.add_parser("channels", help="list | add NAME | remove NAME: channels workers serve")
    common(p)
    p.add_argument("action", choices=["list", "add", "remove"])
    p.add_argument("name", nargs="?")
    p.set_defaults(handler=channels)


async def unknown_channel(redis: aioredis.Redis, keys: Keys, channel: str) -> str | None:
    """Why ``--channel`` names no channel of this deployment (a typo would otherwise list
    or purge nothing and exit 0), or None."""
    if not valid_channel(channel):
        return f"{channel!r} is not a channel name"
    known = await _channels(redis, keys)
    if channel in known:
        return None
    return f"no channel {channel!r} here (known: {', '.join(known) or 'none'})"


async def _channels(redis: aioredis.Redis, keys: Keys, *, discover: bool = True) -> list[str]:
    """Registered channels, and (``discover``: a SCAN of the keyspace) those whose ready
    queue exists."""
    bus = RedisBus(redis, keys.prefix)
    try:
        registry = Registry(bus)
        found = await (registry.channels() if discover else registry.registered_channels())
        return sorted(found)
    finally:
        await bus.aclose()


async def _dead_channels(redis: aioredis.Redis, keys: Keys) -> list[str]:
    """Channels that have dead letters (served or not any more)."""
    head, tail = f"{keys.prefix}:{{", "}:dead"
    found = set()
    async for key in redis.scan_iter(match=f"{glob_escape(keys.prefix)}:{{*}}:dead", count=1000):
        name = text(key)
        if name.startswith(head) and name.endswith(tail):
            found.add(name[len(head) : -len(tail)])
    return sorted(found)


def _age(value: str) -> float:
    """``30d``, ``12h``, ``90m``, ``600s`` or seconds: an age in seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86_400}
    number, unit = (value[:-1], value[-1]) if value[-1:] in units else (value, "s")
    try:
        age = float(number) * units[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not an age like 30d, 12h, 90m or 600s"
        ) from None
    if not math.isfinite(age) or age <= 0:  # (inf and nan parse as floats)
        raise argparse.ArgumentTypeError("the age must be a positive number")
    return age


async def sessions(args: argparse.Namespace, settings: Settings) -> int:
    redis = make_redis(settings.redis_url)
    keys = Keys(settings.key_prefix)
    store = RedisSessionStore(redis, keys, lock_ttl_ms=settings.lock_ttl_ms)
    manager = SessionManager(store)
    try:
        if args.action == "prune":
            if args.older_than is None:
                print("agent-worker: sessions prune needs --older-than AGE", file=sys.stderr)
                return 2
            total = 0
            channels = await _channels(redis, keys)
            for channel in [*channels, "unified"]:  # (the unified session has every
                kept = channels if channel == "unified" else []  # channel's schedules)
                while gone := await store.prune_idle(
                    channel, int(args.older_than * 1000), schedules_of=kept
                ):
                    total += len(gone)
            print(f"deleted {total} sessions idle for at least {args.older_than:.0f} s")
            return 0
        if args.action == "list":
            listed = await manager.list_sessions(args.scope)
            for info in listed:
                print(
                    f"{info['key']}\t{info['scope']}\t{info['messages']} messages\t"
                    f"updated {info['updated_at']}"
                )
            if not listed:
                where = f"scope {args.scope}" if args.scope else "any channel"
                print(f"(no stored sessions in {where})")
            return 0
        if not args.key:
            print("agent-worker: sessions show/delete need a KEY", file=sys.stderr)
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
    try:
        if args.scope is None:
            mode = await redis.get(Keys(settings.key_prefix).mode)
            owner = mode in ("unified", "single-owner") if mode else settings.owner_mode
            if not owner:  # (unified/owner: a memory no session reads here)
                print(
                    f"agent-worker: memory {args.action} needs --scope CHANNEL/NAME: the "
                    f"workers keep one memory per scope here ({mode or 'per-session'} mode; "
                    f"'sessions list' shows each session's scope)",
                    file=sys.stderr,
                )
                return 2
            args.scope = OWNER_SCOPE
        return await _memory(args, MemoryStore(redis, Keys(settings.key_prefix)))
    finally:
        await redis.aclose()


async def _memory(args: argparse.Namespace, store: MemoryStore) -> int:
    channel, sep, name = args.scope.partition("/")
    if not sep or not name or not (valid_channel(channel) or channel == "unified"):
        print(
            f"agent-worker: {args.scope!r} is no scope (CHANNEL/NAME, e.g. web/sender:u1 or "
            f"{OWNER_SCOPE})",
            file=sys.stderr,
        )
        return 2
    if args.action == "show":
        memory_text = await store.read_memory(args.scope)
        if memory_text:
            print(f"(long-term memory of scope {args.scope})", file=sys.stderr)
            print(memory_text)
        else:
            print(
                f"(no long-term memory in scope {args.scope}; a session's scope is "
                f"CHANNEL/sender:ID, CHANNEL/scope:NAME or {OWNER_SCOPE}: see "
                f"'sessions list', then --scope)"
            )
    elif args.action == "set" and not args.text:
        print(
            "agent-worker: memory set needs TEXT (use 'memory clear' to empty it)",
            file=sys.stderr,
        )
        return 2
    else:
        version = await store.write_memory(args.text or "", args.scope)
        print(f"memory of {args.scope} {'set' if args.text else 'cleared'} (version {version})")
    return 0


async def dlq(args: argparse.Namespace, settings: Settings) -> int:
    redis = make_redis(settings.redis_url)
    keys = Keys(settings.key_prefix)
    try:
        if args.channel and not await redis.exists(keys.dead(args.channel)):
            why = await unknown_channel(redis, keys, args.channel)
            if why:
                print(f"agent-worker: {why}", file=sys.stderr)
                return 2
        names = [args.channel] if args.channel else await _dead_channels(redis, keys)
        if args.action == "list":
            shown = 0
            for channel in names:
                for entry_id, raw in await redis.xrange(keys.dead(channel)):
                    doc = json.loads(fields(raw).get("entry", "{}"))
                    print(
                        f"{entry_id}\t{doc.get('session')}\t{doc.get('deliveries')}x\t{doc.get('reason')}"
                    )
                    shown += 1
            if not shown:
                where = f"channel {args.channel}" if args.channel else "any channel"
                print(f"(no dead letters in {where})")
            return 0
        if args.action == "purge":
            count = 0
            for channel in names:
                count += await redis.xlen(keys.dead(channel))
                await redis.delete(keys.dead(channel))
            print(f"purged {count} dead letters")
            return 0
        if not args.entry_id:
            print("agent-worker: dlq show/replay need an ENTRY_ID", file=sys.stderr)
            return 2
        return await _dlq_one(redis, keys, names, args, settings)
    finally:
        await redis.aclose()


async def _dlq_one(
    redis: aioredis.Redis,
    keys: Keys,
    names: list[str],
    args: argparse.Namespace,
    settings: Settings,
) -> int:
    for channel in names:
        found = await redis.xrange(keys.dead(channel), args.entry_id, args.entry_id)
        if not found:
            continue
        doc = json.loads(fields(found[0][1]).get("entry", "{}"))
        if args.action == "show":
            print(json.dumps(doc, indent=2, ensure_ascii=False))
            return 0
        if "payload" not in doc:
            kept = "a prefix of an oversized" if "payload_prefix" in doc else "no text of a private"
            print(
                f"agent-worker: the dead letter keeps {kept} payload: nothing to replay",
                file=sys.stderr,
            )
            return 1
        client = FrontendClient(redis, settings.key_prefix)
        new_id = await client.send_raw(text(doc.get("session")), text(doc.get("payload")))
        await redis.xdel(keys.dead(channel), args.entry_id)
        print(f"replayed as {new_id}")
        return 0
    print(f"no dead letter {args.entry_id}")
    return 1


async def _known_channel(redis: Any, keys: Keys, name: str) -> bool:
    """Whether workers serve NAME or may discover it (its ready queue exists)."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.sismember(keys.channels, name)
        pipe.exists(keys.ready(name))
        served, queued = await pipe.execute()
    return bool(served) or bool(queued)


async def channels(args: argparse.Namespace, settings: Settings) -> int:
    redis = make_redis(settings.redis_url)
    keys = Keys(settings.key_prefix)
    try:
        if args.action == "list":
            print("\n".join(await _channels(redis, keys)))
            return 0
        if not args.name or not valid_channel(args.name):
            print("agent-worker: a channel NAME of letters, digits, '_' or '-'", file=sys.stderr)
            return 2
        if args.action == "remove" and not await _known_channel(redis, keys, args.name):
            print(
                f"agent-worker: no channel {args.name!r}: it is not served and has no ready "
                "queue (see `channels list`); nothing removed",
                file=sys.stderr,
            )
            return 1
        async with redis.pipeline(transaction=True) as tx:
            serve, drop = (
                (keys.channels, keys.removed_channels)
                if args.action == "add"
                else (keys.removed_channels, keys.channels)
            )
            tx.sadd(serve, args.name)
            tx.srem(drop, args.name)
            await tx.execute()
        if args.action == "add":
            print(f"channel {args.name} added")
            return 0
        print(
            f"channel {args.name} removed: workers stop serving it within a maintenance tick "
            "(except those naming it in AGENT_CHANNELS); what its frontends send meanwhile "
            "waits until `channels add`"
        )
        return 0
    finally:
        await redis.aclose()
