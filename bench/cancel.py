"""Cancel latency on loopback against a real redis-server, two ways:

1. in-process: from a frontend's ``stop`` (control script + PUBLISH) until the worker's
   running turn task is cancelled (both ends read one monotonic clock); then the same for
   a ``followup="interrupt"`` message (its MULTI + PUBLISH, and the worker's read of the
   message after the marker);
2. across processes: an ``agent-worker run`` process whose LLM call (a local
   OpenAI-compatible server) hangs; from ``stop`` until the frontend holds the
   ``cancelled`` error event (pub/sub, cancel, fenced commit, reply stream, read).

3. saturated: one ``agent-worker run`` process kept busy by ``--load`` sessions sending
   back to back (each sends its next message when its answer arrives; a process of its
   own), while ``--stops`` blocked turns of other sessions are stopped one at a time by
   another frontend; from ``stop`` until that frontend holds the ``cancelled`` event, and
   on Redis' clock until the event is written.

    python bench/cancel.py [--turns 200] [--load 60] [--stops 20] [--only saturated|in-process]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import redis.asyncio as aioredis
from _common import RedisServer, percentile, summary
from fake_llm import FakeLLM  # tests/ is on sys.path (see _common)
from workers import WorkerProcess

from bus_redis import FrontendClient, InboundMessage, Keys, RedisBus
from worker import AgentLoop, LoopConfig
from worker.agent.providers import LLMResponse


class BlockingProvider:
    """Holds every call until it is cancelled, like a slow LLM."""

    def __init__(self) -> None:
        from worker.agent.providers import GenerationSettings

        self.generation = GenerationSettings()
        self.started: asyncio.Queue[float] = asyncio.Queue()

    def get_default_model(self) -> str:
        return "blocking"

    async def chat_with_retry(self, **_kw: object) -> LLMResponse:
        await self.started.put(time.perf_counter())
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


_TESTS = str(Path(__file__).resolve().parents[1] / "tests")


def quantiles(samples: list[float]) -> str:
    return (
        f"p50 {percentile(samples, 0.5):.1f} ms  p95 {percentile(samples, 0.95):.1f} ms  "
        f"p99 {percentile(samples, 0.99):.1f} ms  max {max(samples):.1f} ms"
    )


async def run(url: str, turns: int, *, interrupt: bool = False) -> list[float]:
    """``interrupt``: the turn is cut by a ``followup="interrupt"`` message of the same
    sender instead of a ``stop`` (the worker reads the message after the marker first)."""
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
        if interrupt:
            again = InboundMessage(
                channel="bench", sender_id="u", chat_id=f"c{i}", content="no", followup="interrupt"
            )
            await frontend.send(again)
        else:
            await frontend.stop(key)
        samples.append((await done - t0) * 1000)
        if interrupt:  # the interrupting message's turn: stopped too
            await provider.started.get()
            await frontend.stop(key)
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


_SERVE = (  # a fake LLM in its own process, printing the text of each held request
    "import time; from fake_llm import FakeLLM; llm = FakeLLM(); "
    "llm.on_block = lambda t: print(t, flush=True); print(llm.start().base_url, flush=True); "
    "time.sleep(3600)"
)


async def keep_busy(url: str, load: int) -> None:
    """The load: ``load`` sessions, each sending again when answered, until killed; prints
    ``warm`` once the worker has served 20 turns per session."""
    redis = aioredis.from_url(url, decode_responses=True)
    frontend, keys, turns = FrontendClient(redis), Keys(), 0
    position = {keys.out(f"sat:load{s}"): "0" for s in range(load)}
    for s in range(load):
        await frontend.send(
            InboundMessage(channel="sat", sender_id="u", chat_id=f"load{s}", content="hi")
        )
    while True:
        reply = await redis.xread(position, count=100, block=1000)  # type: ignore[arg-type]
        for stream, batch in reply or []:
            position[stream] = batch[-1][0]
            for _eid, fields in batch:
                if json.loads(fields["payload"])["type"] in ("message", "error"):
                    turns += 1
                    if turns == load * 20:
                        print("warm", flush=True)
                    chat = stream.rsplit(":", 1)[1]
                    await frontend.send(
                        InboundMessage(channel="sat", sender_id="u", chat_id=chat, content="hi")
                    )


async def saturated(url: str, load: int, stops: int) -> tuple[list[float], list[float]]:
    """The fake LLM and the load run in processes of their own: the one measuring is a
    frontend that only stops (as a gateway replica would), not the saturated load's
    reader. Returns the latencies read by this frontend, and on Redis' clock (its time
    before the stop to the `cancelled` event's id: ms resolution)."""
    llm = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _SERVE, stdout=asyncio.subprocess.PIPE, cwd=_TESTS
    )
    assert llm.stdout is not None
    base_url = (await llm.stdout.readline()).decode().strip()
    env = {
        "AGENT_PROVIDER": "openai",
        "OPENAI_BASE_URL": base_url,
        "OPENAI_API_KEY": "x",
        "AGENT_LOG_LEVEL": "WARNING",
        "AGENT_MODEL": "m",
        "AGENT_CHANNELS": "sat",
        "AGENT_JOBS": "local",
    }
    redis = aioredis.from_url(url, decode_responses=True)
    worker = WorkerProcess(url, worker_id="cancel-sat", env={**os.environ, **env})
    frontend = FrontendClient(redis)
    busy = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--keep-busy", url, "--load", str(load),
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert busy.stdout is not None
    pulse = Keys().pulse("sat")
    samples: list[float] = []
    on_redis: list[float] = []
    try:
        # warm: the worker is saturated before the first stop
        if (await busy.stdout.readline()).strip() != b"warm":
            raise RuntimeError("the load process ended before the worker was saturated")
        t_load, served = time.perf_counter(), await _added(redis, pulse)
        for i in range(stops):
            key = f"sat:stop{i}"
            text = f"block {i}"
            replies = frontend.events([key], after="0", block_ms=100)
            await frontend.send(
                InboundMessage(channel="sat", sender_id="u", chat_id=f"stop{i}", content=text)
            )
            while (await llm.stdout.readline()).decode().strip() != text:
                pass  # the call is held by the server: the turn is running
            seconds, micros = await redis.time()
            t0 = time.perf_counter()
            await frontend.stop(key)
            ev = await anext(replies)
            samples.append((time.perf_counter() - t0) * 1000)
            assert ev.code == "cancelled", ev
            written_ms = int((ev.entry_id or "0-0").split("-")[0])
            on_redis.append(written_ms - (seconds * 1000 + micros / 1000))
        served = await _added(redis, pulse) - served - stops  # (the stops' own events)
        rate = served / (time.perf_counter() - t_load)
        print(f"saturated: {load} sessions back to back, {rate:.0f} turns/s during the stops")
    finally:
        busy.kill()
        worker.close()
        llm.kill()
        await asyncio.gather(busy.wait(), llm.wait())
    return samples, on_redis


async def _added(redis: aioredis.Redis, key: str) -> int:
    """Events written on the channel so far (its pulse's ``entries-added``)."""
    return int((await redis.xinfo_stream(key))["entries-added"])


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--load", type=int, default=60)
    parser.add_argument("--stops", type=int, default=20)
    parser.add_argument("--only", choices=["saturated", "in-process"])
    parser.add_argument("--keep-busy", metavar="URL", help=argparse.SUPPRESS)  # the load
    args = parser.parse_args()
    if args.keep_busy:
        await keep_busy(args.keep_busy, args.load)
        return
    server = RedisServer().start()
    try:
        if args.only == "saturated":
            _print_saturated(*await saturated(server.url, args.load, args.stops))
            return
        samples = await run(server.url, args.turns)
        print(f"in-process, {len(samples)} stops (stop -> turn task cancelled): {summary(samples)}")
        samples = await run(server.url, args.turns, interrupt=True)
        print(
            f"in-process, {len(samples)} interrupts (send -> turn task cancelled): {summary(samples)}"
        )
        if args.only == "in-process":
            return
        samples = await across_processes(server.url, args.turns)
        print(
            f"across processes, {len(samples)} stops (stop -> `cancelled` event read): {summary(samples)}"
        )
        _print_saturated(*await saturated(server.url, args.load, args.stops))
    finally:
        server.cleanup()


def _print_saturated(samples: list[float], on_redis: list[float]) -> None:
    print(f"  {len(samples)} stops (stop -> `cancelled` event read): {quantiles(samples)}")
    print(f"  on Redis' clock (stop -> `cancelled` event written): {quantiles(on_redis)}")


if __name__ == "__main__":
    asyncio.run(main())
