"""Redis time a turn of the worker's own scripts against the baseline loop's, alone.

    python bench/scripts_cost.py [--turns 3000] [--sessions 100] [--repeat 3]

One process, one turn at a time, on a redis-server of its own with nothing else running:
each round publishes one message to each of ``--sessions`` sessions (the real frontend
client), reads their notifications, then runs every session's turn as the worker runs it
(``RedisBus.acquire``: ``lua/acquire.lua``; ``RedisBus.commit`` with the session selected:
``lua/commit.lua``), or as the baseline loop does (``bench/lua/take.lua``,
``bench/lua/done.lua``), alternately. ``INFO commandstats`` before and after each round's
turns gives Redis' own time a turn: ``EVALSHA`` (a script's whole run), the commands inside
the scripts, and how many there were. Without other clients and without the load of
bench/baseline.py its spread between runs is ~±10% (bench/baseline.py's turns/s: ±15-30%):
enough to show what a change of several commands inside the scripts does to Redis' cost,
not a change of one (alternate old and new, several repetitions each).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from _common import RedisServer

from bus_redis import FrontendClient, InboundMessage, Keys
from bus_redis.results import Acquired, CommitSpec, Entry, Notification
from bus_redis.streams import WORKER_GROUP, RedisBus

LUA = Path(__file__).resolve().parent / "lua"
CHANNEL = "base"
META = json.dumps({"scope": "", "metadata": {}, "last_consolidated": 0})


async def _stats(redis: aioredis.Redis) -> dict[str, tuple[int, int]]:
    stats = await redis.info("commandstats")
    return {k.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"])) for k, v in stats.items()}


class _Turns:
    def __init__(self, redis: aioredis.Redis, bus: RedisBus, take: str, done: str) -> None:
        self.redis, self.bus, self.take, self.done = redis, bus, take, done
        self.keys = Keys()

    async def worker(self, note: Notification) -> None:
        key = note.session_key
        got = await self.bus.acquire(key, "bench", member=key, note=note)
        assert isinstance(got, Acquired), got
        assert isinstance(got.step, Entry), got
        text = json.loads(got.step.payload)["content"]
        event = {"type": "message", "session_key": key, "content": f"echo: {text}"}
        rows = [
            json.dumps({"role": "user", "content": text}),
            json.dumps({"role": "assistant", "content": f"echo: {text}"}),
        ]
        spec = CommitSpec(
            member=key, entry_ids=[got.step.entry_id], reply=json.dumps(event), meta=META,
            rows=rows,
        )  # fmt: skip
        version, _gen, _step = await self.bus.commit(key, got.token, "bench", spec, select=[key])
        assert version > 0

    async def loop(self, note: Notification) -> None:
        key, k = note.session_key, self.keys
        token = secrets.token_hex(8)
        lease, history = f"{k.prefix}:base:lease:{key}", f"{k.prefix}:base:history:{key}"
        inbound = k.inbound(key)
        got = await self.redis.evalsha(self.take, 3, lease, inbound, history, token, "10000")  # type: ignore[misc]
        assert got, "nothing taken"
        text = json.loads(got[1])["content"]
        event = json.dumps({"type": "message", "session_key": key, "content": f"echo: {text}"})
        user = json.dumps({"role": "user", "content": text})
        assistant = json.dumps({"role": "assistant", "content": f"echo: {text}"})
        keys = [lease, inbound, history, k.out(key), note.stream, k.pulse(CHANNEL)]
        args = [token, got[0], user, assistant, event, note.entry_id, 1000]
        assert await self.redis.evalsha(self.done, len(keys), *keys, *args) == 1  # type: ignore[misc]


async def measure(system: str, turns: int, sessions: int) -> dict[str, float]:
    server = RedisServer().start()
    try:
        redis = aioredis.from_url(server.url)
        bus = RedisBus(redis)
        await bus.scripts.load_all()
        take = await redis.script_load((LUA / "take.lua").read_text())
        done = await redis.script_load((LUA / "done.lua").read_text())
        front = FrontendClient(aioredis.from_url(server.url, decode_responses=True))
        ready = bus.keys.ready(CHANNEL)
        await redis.xgroup_create(ready, WORKER_GROUP, id="0", mkstream=True)
        run = getattr(_Turns(redis, bus, take, done), system)
        total: dict[str, list[int]] = {}
        for round_ in range(max(1, turns // sessions)):
            for i in range(sessions):
                await front.send(
                    InboundMessage(
                        channel=CHANNEL, sender_id="u", chat_id=f"c{i}",
                        content=f"message {round_}", session_key=f"{CHANNEL}:c{i}",
                    )
                )  # fmt: skip
            reply = await redis.xreadgroup(WORKER_GROUP, "bench", {ready: ">"}, count=sessions)
            notes = [
                Notification(ready, nid.decode(), fields[b"session"].decode())
                for nid, fields in reply[0][1]
            ]
            before = await _stats(redis)
            for note in notes:
                await run(note)
            after = await _stats(redis)
            for name, (calls, usec) in after.items():
                was = before.get(name, (0, 0))
                got = total.setdefault(name, [0, 0, 0])
                got[0] += calls - was[0]
                got[1] += usec - was[1]
                got[2] += len(notes) if name == "evalsha" else 0
        n = total["evalsha"][2]
        inner = {k: v for k, v in total.items() if k not in ("evalsha", "info")}
        return {
            "evalsha": total["evalsha"][1] / n,
            "inner": sum(v[1] for v in inner.values()) / n,
            "calls": sum(v[0] for v in inner.values()) / n,
        }
    finally:
        server.cleanup()


def _spread(values: list[float]) -> str:
    return f"{min(values):.1f} / {statistics.median(values):.1f} / {max(values):.1f}"


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--turns", type=int, default=3000)
    parser.add_argument("--sessions", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {"worker": [], "loop": []}
    for _ in range(args.repeat):
        for system in runs:  # alternating, a fresh server each
            runs[system].append(await measure(system, args.turns, args.sessions))
    print(
        f"{args.turns} turns, {args.sessions} sessions, {args.repeat} repetitions: min / median / max"
    )
    for system, label in (("worker", "worker's scripts"), ("loop", "the loop's")):
        rs: list[dict[str, Any]] = runs[system]
        print(f"{label}:")
        print(f"  EVALSHA          {_spread([r['evalsha'] for r in rs])} µs a turn (whole runs)")
        print(f"  inner commands   {_spread([r['inner'] for r in rs])} µs a turn")
        print(f"  of them          {_spread([r['calls'] for r in rs])} commands a turn")


if __name__ == "__main__":
    asyncio.run(main())
