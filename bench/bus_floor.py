"""The worker's own scripts and bus, without the worker: where bench/baseline.py's gap is.

    python bench/bus_floor.py REDIS_URL CHANNEL [CONSUMER]

Reads the channel's ready queue as bench/baseline_loop.py does (``XREADGROUP``, group
``workers``, 64 turns at once), and for each notification runs the worker's own lease and
commit path: ``RedisBus.acquire`` (``lua/acquire.lua``: lease, pending set, lease
registry, the first entry, the notification acknowledged and deleted), an echo answer,
``RedisBus.commit`` (``lua/commit.lua``: fenced rows, the reply event and its pulse, the
entry deleted, the next entry selected or the lease released), as often as the session
has entries. What it writes has the shape and size of what the worker writes for an echo
turn (the two rows with timestamps, message id and sender; the session's meta with its
scope, so that the commit names the scope's index; the reply event as the worker encodes
it; the scope's memory hash named in acquire), built as plain JSON, without the worker's
models. No prompt, no policy, no tasks per turn beyond the loop's: its turns/s next to
the loop's and the worker's tell how much of the worker's gap is its scripts and bus
(this) and how much the worker's own turn path (the rest). Not a worker: it keeps no
session cache, renews no lease, answers no control; a turn that meets anything but a
lease and an entry (none does under bench/baseline.py's load) ends the process, so that
the load stalls loudly instead of a silent skip.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from typing import NoReturn

import redis.asyncio as aioredis

from bus_redis.results import Acquired, CommitSpec, Entry, Notification, Released
from bus_redis.streams import WORKER_GROUP, RedisBus
from session_store.codec import dumps
from session_store.models import now_iso

CONCURRENCY = 64


async def main(url: str, channel: str, consumer: str = "floor") -> None:
    redis = aioredis.from_url(url)
    bus = RedisBus(redis)
    await bus.scripts.load_all()
    ready = bus.keys.ready(channel)
    with contextlib.suppress(aioredis.ResponseError):  # the group exists
        await redis.xgroup_create(ready, WORKER_GROUP, id="0", mkstream=True)
    slots = asyncio.Semaphore(CONCURRENCY)

    def fail(what: str) -> NoReturn:
        print(f"bus_floor: {what}", file=sys.stderr, flush=True)
        os._exit(1)

    async def turn(note: Notification) -> None:
        async with slots:
            key = note.session_key
            scope = f"{channel}/sender:u"
            got = await bus.acquire(
                key, consumer, member=key, note=note, memory_key=bus.keys.memory(scope)
            )
            if not isinstance(got, Acquired) or not isinstance(got.step, Entry):
                fail(f"acquire of {key}: {got!r}")
            step: object = got.step
            token = got.token
            while isinstance(step, Entry):
                payload = json.loads(step.payload)
                text = payload.get("content", "")
                message_id = payload.get("id") or step.entry_id
                answer, now = f"echo: {text}", now_iso()
                user = {"role": "user", "content": text, "timestamp": now}
                user |= {"message_id": message_id, "sender_id": payload.get("sender_id", "")}
                rows = [user, {"role": "assistant", "content": answer, "timestamp": now}]
                meta: dict[str, object] = {"key": key, "created_at": now, "updated_at": now}
                meta |= {"metadata": {}, "last_consolidated": 0, "scope": scope}
                event: dict[str, object] = {
                    "v": 2, "type": "message", "channel": payload["channel"],
                    "chat_id": payload["chat_id"], "session_key": key, "reply_to": message_id,
                    "content": answer, "metadata": {},
                }  # fmt: skip
                spec = CommitSpec(
                    member=key, entry_ids=[step.entry_id], scope=scope, meta=dumps(meta),
                    rows=[dumps(r) for r in rows], reply=dumps(event),
                )  # fmt: skip
                version, _gen, step = await bus.commit(key, token, consumer, spec, select=[key])
                if version < 0:
                    fail(f"commit of {key}: {step!r}")
            if not isinstance(step, Released):
                fail(f"after the commits of {key}: {step!r}")

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
