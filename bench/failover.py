"""Crash failover with the default settings: kill -9 the worker holding a session in the
middle of a model call; how long until the dead worker's lease is gone (taken over by a
survivor, or run out) and until the frontend has the survivor's answer.

    python bench/failover.py [--repeat 5] [--liveness-ms 800]

Two ``agent-worker run`` processes, a local OpenAI-compatible server that holds the call
until the kill; ``--liveness-ms 0`` measures failover by lease expiry only (the 10 s
lease TTL plus the next maintenance tick).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import redis.asyncio as aioredis
from _common import RedisServer
from fake_llm import FakeLLM  # tests/ is on sys.path (see _common)
from workers import WorkerProcess

from bus_redis import FrontendClient, InboundMessage, Keys


async def once(url: str, llm: FakeLLM, n: int, liveness_ms: int) -> tuple[float, float]:
    redis = aioredis.from_url(url, decode_responses=True)
    await redis.flushall()
    env = {
        "AGENT_PROVIDER": "openai",
        "OPENAI_BASE_URL": llm.base_url,
        "OPENAI_API_KEY": "x",
        "AGENT_MODEL": "m",
        "AGENT_LOG_LEVEL": "WARNING",
        "AGENT_CHANNELS": "fo",
        "AGENT_JOBS": "local",
        "AGENT_LIVENESS_MS": str(liveness_ms),
    }
    workers = {f"fo{n}-{i}": WorkerProcess(url, worker_id=f"fo{n}-{i}", env=env) for i in range(2)}
    client = FrontendClient(redis)
    lease = Keys().lease("fo:c")
    try:
        while len(await redis.zrange(Keys().alive, 0, -1)) < 2 and liveness_ms:
            await asyncio.sleep(0.05)  # both workers are up
        llm.rearm()
        replies = client.events(["fo:c"], after="0", block_ms=100)
        await client.send(InboundMessage(channel="fo", sender_id="u", chat_id="c", content="block"))
        while not llm.started.is_set():
            await asyncio.sleep(0.005)
        held = await redis.get(lease)
        assert held is not None
        t0 = time.perf_counter()
        workers[held.split("|", 1)[1]].kill()
        llm.release()  # the survivor's call is answered at once
        while await redis.get(lease) == held:  # deleted by a takeover, or ran out
            await asyncio.sleep(0.002)
        taken = time.perf_counter() - t0
        async for ev in replies:
            if ev.is_terminal:
                break
        answered = time.perf_counter() - t0
        assert ev.type == "message", ev
    finally:
        for w in workers.values():
            w.close()
        await redis.aclose()
    return taken, answered


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--liveness-ms", type=int, default=800)
    args = parser.parse_args()
    server = RedisServer().start()
    llm = FakeLLM().start()
    try:
        runs = [await once(server.url, llm, n, args.liveness_ms) for n in range(args.repeat)]
    finally:
        llm.stop()
        server.cleanup()
    for name, values in (("taken over", [r[0] for r in runs]), ("answered", [r[1] for r in runs])):
        print(
            f"kill -9 -> {name}: min {min(values):.2f} s  median {statistics.median(values):.2f} s"
            f"  max {max(values):.2f} s  ({len(values)} kills, AGENT_LIVENESS_MS "
            f"{args.liveness_ms})"
        )


if __name__ == "__main__":
    asyncio.run(main())
