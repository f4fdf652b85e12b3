"""What a maintenance tick's renewal of private sessions costs a worker that owns many.

A worker renews the owner record of each private session it owns on every maintenance
tick (a third of the lease TTL); a channel may have ``AGENT_MAX_PRIVATE_SESSIONS``
(1,000) open, and a worker may own those of several channels. Prints the time of one
``renew_owned`` (min / median / max over ``--repeat``) for each count of owned sessions.

    .venv/bin/python bench/ticks.py [--owned 100,1000,3000] [--repeat 7]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import redis.asyncio as aioredis
from _common import RedisServer
from helpers import ScriptedProvider

from bus_redis import RedisBus
from worker import AgentLoop, LoopConfig


async def run(url: str, owned: int, repeat: int) -> list[float]:
    bus = RedisBus(aioredis.from_url(url))  # as a worker makes it (worker/app.py)
    loop = AgentLoop(bus, ScriptedProvider(), config=LoopConfig(worker_id="w1"))
    await bus.scripts.load_all()
    members = {f"web:c{i}": f"web:c{i}" for i in range(owned)}
    async with bus.raw.pipeline(transaction=False) as pipe:
        for key in members:  # the records this worker owns
            pipe.hset(bus.keys.owner(key), "worker", "w1")
        await pipe.execute()
    loop.rt.turns.owned = lambda: members  # type: ignore[method-assign]
    took: list[float] = []
    for _ in range(repeat):
        start = time.perf_counter()
        await loop.maintenance.renew_owned()
        took.append((time.perf_counter() - start) * 1000)
    assert all([await bus.raw.exists(bus.keys.owner(k)) for k in list(members)[:10]])
    await bus.raw.flushall()
    await bus.aclose()
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--owned", default="100,1000,3000")
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    server = RedisServer().start()
    try:
        for owned in (int(n) for n in args.owned.split(",")):
            took = asyncio.run(run(server.url, owned, args.repeat))
            print(
                f"{owned:>5} owned: renew_owned {min(took):.1f} / "
                f"{statistics.median(took):.1f} / {max(took):.1f} ms (min / median / max)"
            )
    finally:
        server.stop()


if __name__ == "__main__":
    main()
