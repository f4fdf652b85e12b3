"""Reading replies in tests: wait for terminal events by ``reply_to``."""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import Awaitable, Callable

from bus_redis import FrontendClient, OutboundMessage

_SEEN: weakref.WeakKeyDictionary[FrontendClient, dict[str, dict[str, list[OutboundMessage]]]] = (
    weakref.WeakKeyDictionary()
)


async def collect(
    client: FrontendClient, channel: str, want: set[str], *, timeout_s: float = 30
) -> dict[str, list[OutboundMessage]]:
    """Events of ``channel`` until every id in ``want`` got a terminal event.

    Events read by an earlier call with the same client are remembered (reading acks and
    deletes them), so consecutive calls never lose one another's replies.
    """
    got = _SEEN.setdefault(client, {}).setdefault(channel, {})

    def missing() -> set[str]:
        return {rid for rid in want if not any(ev.is_terminal for ev in got.get(rid, []))}

    async def read() -> None:
        if not missing():
            return
        async with contextlib.aclosing(
            client.replies(channel, group="tests", block_ms=200)
        ) as events:
            async for ev in events:
                for rid in [ev.reply_to or "", *(ev.covers or [])]:
                    got.setdefault(rid, []).append(ev)
                if not missing():
                    return

    try:
        await asyncio.wait_for(read(), timeout_s)
    except TimeoutError:
        raise AssertionError(
            f"no terminal reply for {sorted(missing())[:5]} within {timeout_s}s"
        ) from None
    return {rid: list(evs) for rid, evs in got.items()}


async def wait_until_async(predicate: Callable[[], Awaitable[bool]], *, timeout_s: float) -> bool:
    """Poll a condition that lives in another process (a worker's heartbeat record)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await predicate():
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True
