"""Reading events in tests: wait for terminal events by ``reply_to``."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis

from bus_redis import FrontendClient, Keys, OutboundMessage
from bus_redis.keys import glob_escape

TEST_CHANNELS = ("web", "cli", "telegram", "bench", "system", "other")


async def channel_events(client: FrontendClient, channel: str) -> list[OutboundMessage]:
    """Every event still kept in the sessions of ``channel`` (events are not consumed by
    reading, so this may be called again and again)."""
    pattern = f"{glob_escape(client.keys.prefix)}:{{{channel}}}:out:*"
    events: list[OutboundMessage] = []
    async for stream in client.redis.scan_iter(match=pattern, count=1000, _type="stream"):
        for eid, raw in await client.redis.xrange(stream):
            fields = raw if isinstance(raw, dict) else {}
            try:
                ev = OutboundMessage.model_validate_json(fields.get("payload", ""))
            except ValueError:
                continue
            ev.entry_id = eid
            events.append(ev)
    return events


async def collect(
    client: FrontendClient, channel: str, want: set[str], *, timeout_s: float = 30
) -> dict[str, list[OutboundMessage]]:
    """Events of ``channel`` by reply id, once every id in ``want`` got a terminal event."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        got: dict[str, list[OutboundMessage]] = {}
        for ev in await channel_events(client, channel):
            for rid in {ev.reply_to or "", *(ev.covers or [])}:
                got.setdefault(rid, []).append(ev)
        missing = {rid for rid in want if not any(e.is_terminal for e in got.get(rid, []))}
        if not missing:
            return got
        if loop.time() > deadline:
            raise AssertionError(f"no terminal reply for {sorted(missing)[:5]} within {timeout_s}s")
        await asyncio.sleep(0.02)  # poll: the events live in another task or process


async def wait_until_async(predicate: Callable[[], Awaitable[bool]], *, timeout_s: float) -> bool:
    """Poll a condition that lives in another process (a worker's heartbeat record)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await predicate():
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def until(predicate: Callable[[], bool | Awaitable[bool]], *, timeout_s: float = 10) -> None:
    """Poll a condition another task brings about, within a bound (fails the test after)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        result = predicate()
        if result if isinstance(result, bool) else await result:
            return
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def open_private(client: FrontendClient, chat: str, *, channel: str = "web") -> str:
    """Open a private session on ``<channel>:<chat>`` and wait for its answer; its key."""
    key, opened = await client.open_transient(channel, chat, session_key=f"{channel}:{chat}")
    await collect(client, channel, {opened})
    return key


async def spawn_replies(client: FrontendClient, session: str) -> list[str]:
    """The ids (``spawn:<sid>``) of the subagent results answered in ``session``."""
    return [
        e.reply_to or ""
        for e in await channel_events(client, "web")
        if (e.reply_to or "").startswith("spawn:") and e.session_key == session and e.is_terminal
    ]


async def no_leftovers(redis: aioredis.Redis, keys: list[str]) -> None:
    """Within a few lease terms: no lease, pending set, journal or queued entry of
    ``keys`` stays (the survivor serves them, then lets go)."""
    k = Keys()

    async def clean() -> bool:
        names = []
        for key in keys:
            names += [k.lease(key), k.pending(key), k.journal(key)]
        if await redis.exists(*names):
            return False
        lengths = [await redis.xlen(k.inbound(key)) for key in keys]
        return not any(lengths)

    try:
        await until(clean, timeout_s=15)
    except AssertionError:
        left = {
            n: await redis.type(n)
            for key in keys
            for n in (k.lease(key), k.pending(key), k.journal(key), k.inbound(key))
            if await redis.exists(n)
        }
        detail = {
            n: (
                await redis.xrange(n)
                if t == "stream"
                else await redis.get(n)
                if t == "string"
                else t
            )
            for n, t in left.items()
        }
        raise AssertionError(f"left behind: {detail}") from None
