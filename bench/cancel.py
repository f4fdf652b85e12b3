"""Cancel latency on loopback against a real redis-server, two ways:

1. in-process: from a frontend's ``stop`` (control script + PUBLISH) until the worker's
   running turn task is cancelled (both ends read one monotonic clock);
2. across processes: an ``agent-worker run`` process whose LLM call (a local
   OpenAI-compatible server) hangs; from ``stop`` until the frontend holds the
   ``cancelled`` error event (pub/sub, cancel, fenced commit, reply stream, read).

    python bench/cancel.py [--turns 200]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import redis.asyncio as aioredis
from _common import RedisServer, summary
from fake_llm import FakeLLM  # tests/ is on sys.path (see _common)
from workers import WorkerProcess

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
    loop = AgentLoop(
        RedisBus(aioredis.from_url(url, decode_responses=True)),
        provider,  # type: ignore[arg-type]
        config=LoopConfig(worker_id="cancel-bench", read_block_ms=100, channels=["bench"]),
    )
    frontend = FrontendClient(aioredis.from_url(url, decode_responses=True))
    task = asyncio.create_task(loop.run())
    samples: list[float] = []
    for i in range(turns):
        key = f"bench:c{i}"
        await frontend.send(
            InboundMessage(channel="bench", sender_id="u", chat_id=f"c{i}", content="go")
        )
        await provider.started.get()
        turn = loop.active_tasks[key]
        done = asyncio.get_running_loop().create_future()
        turn.add_done_callback(lambda _t, f=done: f.done() or f.set_result(time.perf_counter()))
        t0 = time.perf_counter()
        await frontend.stop(key)
        samples.append((await done - t0) * 1000)
    loop.stop()
    await task
    return samples


async def across_processes(url: str, turns: int) -> list[float]:
    llm = FakeLLM().start()
    env = {
        "AGENT_PROVIDER": "openai",
        "OPENAI_BASE_URL": llm.base_url,
        "OPENAI_API_KEY": "x",
        "AGENT_LOG_LEVEL": "WARNING",
        "AGENT_MODEL": "m",
        "AGENT_CHANNELS": "proc",
    }
    worker = WorkerProcess(url, worker_id="cancel-proc", env={**os.environ, **env})
    frontend = FrontendClient(aioredis.from_url(url, decode_responses=True))
    samples: list[float] = []
    try:
        for i in range(turns):
            key = f"proc:c{i}"
            await frontend.send(
                InboundMessage(channel="proc", sender_id="u", chat_id=f"c{i}", content="block")
            )
            while len(llm.requests) <= i:
                await asyncio.sleep(0.001)
            replies = frontend.events([key], after="0", block_ms=100)
            t0 = time.perf_counter()
            await frontend.stop(key)
            ev = await anext(replies)
            samples.append((time.perf_counter() - t0) * 1000)
            assert ev.code == "cancelled", ev
    finally:
        worker.close()
        llm.stop()
    return samples


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--turns", type=int, default=200)
    args = parser.parse_args()
    server = RedisServer().start()
    try:
        samples = await run(server.url, args.turns)
        print(f"in-process, {len(samples)} stops (stop -> turn task cancelled): {summary(samples)}")
        samples = await across_processes(server.url, args.turns)
        print(
            f"across processes, {len(samples)} stops (stop -> `cancelled` event read): {summary(samples)}"
        )
    finally:
        server.cleanup()


if __name__ == "__main__":
    asyncio.run(main())
