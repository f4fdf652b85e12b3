"""The worker's own scripts and bus, without the worker: where bench/baseline.py's gap is.

    python bench/bus_floor.py REDIS_URL CHANNEL [CONSUMER]

Reads the channel's ready queue as bench/baseline_loop.py does (``XREADGROUP``, group
``workers``, 64 turns at once), and for each notification runs the worker's own lease and
commit path: ``RedisBus.acquire`` (``lua/acquire.lua``: lease, pending set, lease
registry, the first entry, the notification acknowledged and deleted), an echo answer,
``RedisBus.commit`` (``lua/commit.lua``: fenced rows, the reply event and its pulse, the
entry deleted, the next entry selected or the lease released), as often as the session
has entries. No session model, no prompt, no policy, no tasks per turn beyond the
loop's: its turns/s next to the loop's and the worker's tell how much of the worker's gap
is its scripts and bus (this) and how much the worker's own turn path (the rest).
Not a worker: it keeps no cache, renews no lease, answers no control.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys

import redis.asyncio as aioredis

from bus_redis.results import CommitSpec, Entry, Notification
from bus_redis.streams import WORKER_GROUP, RedisBus

CONCURRENCY = 64
META = json.dumps({"scope": "", "metadata": {}, "last_consolidated": 0})


async def main(url: str, channel: str, consumer: str = "floor") -> None:
    redis = aioredis.from_url(url)
    bus = RedisBus(redis)
    await bus.scripts.load_all()
    ready = bus.keys.ready(channel)
    with contextlib.suppress(aioredis.ResponseError):  # the group exists
        await redis.xgroup_create(ready, WORKER_GROUP, id="0", mkstream=True)
    slots = asyncio.Semaphore(CONCURRENCY)

    async def turn(note: Notification) -> None:
        async with slots:
            key = note.session_key
            got = await bus.acquire(key, consumer, member=key, note=note)
            token, step = getattr(got, "token", ""), getattr(got, "step", None)
            while isinstance(step, Entry):
                payload = json.loads(step.payload)
                text = payload.get("content", "")
                answer = f"echo: {text}"
                event = {
                    "type": "message",
                    "channel": payload["channel"],
                    "chat_id": payload["chat_id"],
                    "session_key": key,
                    "reply_to": payload.get("id") or step.entry_id,
                    "content": answer,
                }
                rows = [
                    json.dumps({"role": "user", "content": text}),
                    json.dumps({"role": "assistant", "content": answer}),
                ]
                spec = CommitSpec(
                    member=key, entry_ids=[step.entry_id], reply=json.dumps(event), meta=META,
                    rows=rows,
                )  # fmt: skip
                _version, _gen, step = await bus.commit(key, token, consumer, spec, select=[key])

    tasks: set[asyncio.Task[None]] = set()
    while True:
        reply = await redis.xreadgroup(WORKER_GROUP, consumer, {ready: ">"}, count=64, block=100)
        for stream, entries in reply or []:
            for note_id, fields in entries:
                note = Notification(stream.decode(), note_id.decode(), fields[b"session"].decode())
                task = asyncio.create_task(turn(note))
                tasks.add(task)
                task.add_done_callback(tasks.discard)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
