"""The yardstick of bench/baseline.py: a minimal fenced Lua turn loop on the same wire.

    python bench/baseline_loop.py REDIS_URL CHANNEL [CONSUMER] [plain]

Reads the channel's ready queue (``XREADGROUP``, group ``workers``), and for each
notification: ``take.lua`` (lease NX PX, first queued entry, last 40 history rows), an echo
answer, ``done.lua`` (fenced: append two rows, the reply event, delete the entry,
acknowledge the notification, release). No policy, no sessions model, no recovery: what a
turn costs at the least on Redis, with the same frontends and the same event format. Its
scripts go over the same multiplexed connection as the worker's (``bus_redis.mux``), so
the yardstick pays what the worker pays per command, not redis-py's pool. With ``plain``,
the same two scripts go through redis-py's own client (``register_script``, its connection
pool) instead: the loop written the ordinary way, as issue 15 measured its yardstick.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from bus_redis import Keys
from bus_redis.keys import channel_of
from bus_redis.mux import Multiplexed

LUA = Path(__file__).resolve().parent / "lua"
CONCURRENCY = 64


async def main(url: str, channel: str, consumer: str = "base", client: str = "") -> None:
    redis = aioredis.from_url(url, decode_responses=True)
    keys = Keys()
    ready = keys.ready(channel)
    take: Callable[..., Awaitable[Any]]
    done: Callable[..., Awaitable[Any]]
    plain = client == "plain"
    if plain:  # redis-py's client as it comes (replies decoded to str)
        take = redis.register_script((LUA / "take.lua").read_text())
        done = redis.register_script((LUA / "done.lua").read_text())
    else:
        fast = Multiplexed.for_client(redis)
        assert fast is not None
        take_sha = await redis.script_load((LUA / "take.lua").read_text())
        done_sha = await redis.script_load((LUA / "done.lua").read_text())

        async def take(keys: list[str], args: list[object]) -> Any:
            return await fast.execute("EVALSHA", take_sha, len(keys), *keys, *args)

        async def done(keys: list[str], args: list[object]) -> Any:
            return await fast.execute("EVALSHA", done_sha, len(keys), *keys, *args)

    with contextlib.suppress(aioredis.ResponseError):  # the group exists
        await redis.xgroup_create(ready, "workers", id="0", mkstream=True)
    slots = asyncio.Semaphore(CONCURRENCY)

    async def turn(note_id: str, session: str) -> None:
        async with slots:
            token = secrets.token_hex(8)
            lease, inbound = f"{keys.prefix}:base:lease:{session}", keys.inbound(session)
            history = f"{keys.prefix}:base:history:{session}"
            got = await take(keys=[lease, inbound, history], args=[token, 10_000])
            if not got:
                await redis.xack(ready, "workers", note_id)
                return
            entry_id, payload = got[0] if plain else got[0].decode(), json.loads(got[1])
            text = payload.get("content", "")
            event = json.dumps(
                {
                    "type": "message",
                    "channel": payload["channel"],
                    "chat_id": payload["chat_id"],
                    "session_key": session,
                    "reply_to": payload.get("id") or entry_id,
                    "content": f"echo: {text}",
                }
            )
            user = json.dumps({"role": "user", "content": text})
            assistant = json.dumps({"role": "assistant", "content": f"echo: {text}"})
            out = keys.out(session)
            await done(
                keys=[lease, inbound, history, out, ready, keys.pulse(channel_of(session))],
                args=[token, entry_id, user, assistant, event, note_id, 1000],
            )

    tasks: set[asyncio.Task[None]] = set()
    while True:
        reply = await redis.xreadgroup("workers", consumer, {ready: ">"}, count=64, block=100)
        for _stream, entries in reply or []:
            for note_id, fields in entries:
                task = asyncio.create_task(turn(note_id, fields["session"]))
                tasks.add(task)
                task.add_done_callback(tasks.discard)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5]))
