"""Cancel latency: from a frontend's ``stop`` (control script + PUBLISH) until the worker's
running turn task is cancelled, on loopback against a real redis-server.

    python bench/cancel.py [--turns 200]

The worker and the frontend are separate Redis clients in one process, so both ends read
the same monotonic clock.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import redis.asyncio as aioredis
from _common import RedisServer, summary

from bus_redis import FrontendClient, InboundMessage, RedisBus
from worker import AgentLoop, LoopConfig
from worker.providers import LLMResponse


class BlockingProvider:
    """Holds every call until it is cancelled, like a slow LLM."""

    def __init__(self) -> None:
        from worker.providers import GenerationSettings

        self.generation = GenerationSettings()
        self.started: asyncio.Queue[float] = asyncio.Queue()

    def get_default_model(self) -> str:
        return "blocking"

    async def chat_with_retry(self, **_kw: object) -> LLMResponse:
        await self.started.put(time.perf_counter())
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


async def run(url: str, turns: int) -> list[float]:
    provider = BlockingProvider()
    loop = AgentLoop(RedisBus(aioredis.from_url(url, decode_responses=True)), provider,  # type: ignore[arg-type]
                     config=LoopConfig(worker_id="cancel-bench", read_block_ms=100))
    frontend = FrontendClient(aioredis.from_url(url, decode_responses=True))
    task = asyncio.create_task(loop.run())
    samples: list[float] = []
    for i in range(turns):
        key = f"bench:c{i}"
        await frontend.send(InboundMessage(channel="bench", sender_id="u", chat_id=f"c{i}", content="go"))
        await provider.started.get()
        turn = next(iter(loop.active_tasks[key]))
        done = asyncio.get_running_loop().create_future()
        turn.add_done_callback(lambda _t, f=done: f.done() or f.set_result(time.perf_counter()))
        t0 = time.perf_counter()
        await frontend.stop(key)
        samples.append((await done - t0) * 1000)
    loop.stop()
    await task
    return samples


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=200)
    args = parser.parse_args()
    server = RedisServer().start()
    try:
        samples = await run(server.url, args.turns)
    finally:
        server.cleanup()
    print(f"cancel latency over {len(samples)} stops (publish -> turn task cancelled): {summary(samples)}")


if __name__ == "__main__":
    asyncio.run(main())
