"""The OpenAI-compatible provider path: client CPU per call, and a slow provider's throughput.

    python bench/provider.py [--calls 300] [--history 40] [--turns 1280] [--latency 0.2]

1. CPU per chat call of ``OpenAIProvider`` (event-loop thread CPU, so the local server's
   threads are not counted), against the openai SDK's ``chat.completions.create`` and a
   raw ``httpx`` POST and a raw ``httpcore`` POST of the same request (the provider is
   built on the latter), plain and streamed; ``--history`` messages per request.
2. One ``agent-worker run`` process, ``AGENT_CONCURRENCY`` 64, against a local server
   answering every call after ``--latency`` seconds: turns/s against the ideal
   64 / latency (the load keeps 64 sessions with one message in flight).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpcore2
import httpx2
import redis.asyncio as aioredis
from _common import RedisServer
from openai import AsyncOpenAI
from workers import WorkerProcess  # tests/ is on sys.path (see _common)

from bus_redis import FrontendClient, InboundMessage, Keys
from worker.agent.providers import OpenAIProvider


def _messages(history: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = [{"role": "system", "content": "You are a bench. " * 40}]
    for i in range(history):
        role = "user" if i % 2 == 0 else "assistant"
        rows.append({"role": role, "content": f"message {i} " + "lorem ipsum " * 20})
    rows.append({"role": "user", "content": "the question"})
    return rows


async def _cpu_per_call(make: Any, calls: int) -> float:
    """Median over 3 rounds of main-thread CPU per call, in ms."""
    rounds = []
    for _ in range(3):
        for _ in range(10):
            await make()  # warm: connections, caches
        cpu0 = time.thread_time()
        for _ in range(calls):
            await make()
        rounds.append((time.thread_time() - cpu0) / calls * 1000)
    return statistics.median(rounds)


_TESTS = str(Path(__file__).resolve().parents[1] / "tests")
_SERVE = (
    "import sys, time; from fake_llm import FakeLLM; s = float(sys.argv[1]); "
    "print(FakeLLM(latency_s=(s, s)).start().base_url, flush=True); time.sleep(3600)"
)


@contextlib.contextmanager
def fake_llm(latency_s: float = 0.0) -> Iterator[str]:
    """A local OpenAI-compatible server in its own process (its threads share no GIL with
    the process measured); yields its base URL."""
    server = subprocess.Popen(
        [sys.executable, "-c", _SERVE, str(latency_s)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=_TESTS,
    )
    try:
        assert server.stdout is not None
        yield server.stdout.readline().strip()
    finally:
        server.kill()
        server.wait()


async def client_cpu(base_url: str, calls: int, history: int) -> None:
    messages = _messages(history)
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": "a tool " * 10,
                "parameters": {
                    "type": "object",
                    "properties": {"a": {"type": "string"}, "b": {"type": "integer"}},
                    "required": ["a"],
                },
            },
        }
        for i in range(8)
    ]
    provider = OpenAIProvider("m", base_url=base_url, api_key="x")
    sdk = AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0)
    raw = httpx2.AsyncClient(base_url=base_url)
    core = httpcore2.AsyncConnectionPool()
    body = {"model": "m", "messages": messages, "tools": tools, "max_tokens": 100}

    async def ours() -> None:
        await provider.chat_with_retry(messages=messages, tools=tools)

    async def ours_streamed() -> None:
        async def sink(_piece: str) -> None:
            return None

        await provider.chat_with_retry(messages=messages, tools=tools, on_delta=sink)

    async def sdk_create() -> None:
        await sdk.chat.completions.create(**body)  # type: ignore[call-overload]

    async def raw_post() -> None:
        response = await raw.post("/chat/completions", content=json.dumps(body))
        json.loads(response.content)

    async def core_post() -> None:
        response = await core.request(
            "POST", base_url + "/chat/completions", content=json.dumps(body).encode()
        )
        json.loads(response.content)

    print(f"client CPU per call ({history} history messages, 8 tools; event-loop thread):")
    for name, make in (
        ("OpenAIProvider", ours),
        ("OpenAIProvider, streamed", ours_streamed),
        ("openai SDK chat.completions.create", sdk_create),
        ("raw httpx2 POST + json", raw_post),
        ("raw httpcore2 POST + json", core_post),
    ):
        print(f"  {name:36} {await _cpu_per_call(make, calls):.3f} ms")
    await provider.aclose()
    await sdk.close()
    await raw.aclose()
    await core.aclose()


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def slow_provider(url: str, base_url: str, turns: int, latency_s: float) -> float:
    concurrency = 64
    env = {
        "AGENT_PROVIDER": "openai",
        "OPENAI_BASE_URL": base_url,
        "OPENAI_API_KEY": "x",
        "AGENT_MODEL": "m",
        "AGENT_LOG_LEVEL": "WARNING",
        "AGENT_CONCURRENCY": str(concurrency),
        "AGENT_JOBS": "local",
        "AGENT_CHANNELS": "slow",
    }
    redis = aioredis.from_url(url, decode_responses=True)
    await redis.flushall()
    frontend = FrontendClient(redis)
    worker = WorkerProcess(url, worker_id="slow-0", env=env)
    keys = Keys()
    sent = 0
    done = 0
    t0 = 0.0
    try:
        position: dict[str, str] = {}
        for s in range(concurrency):  # closed loop: each session has one message in flight
            await frontend.send(
                InboundMessage(channel="slow", sender_id="u", chat_id=f"c{s}", content="q")
            )
            position[keys.out(f"slow:c{s}")] = "0"
            sent += 1
        while done < turns:
            reply = await redis.xread(position, count=100, block=1000)
            for stream, batch in reply or []:
                for eid, fields in batch:
                    position[stream] = eid
                    if json.loads(fields["payload"])["type"] not in ("message", "error"):
                        continue
                    done += 1
                    if done == concurrency:  # steady state from here
                        t0, base, cpu0 = time.perf_counter(), done, _cpu_s(worker.proc.pid)
                    if sent < turns + concurrency:
                        chat = stream.rsplit(":", 1)[1]
                        await frontend.send(
                            InboundMessage(channel="slow", sender_id="u", chat_id=chat, content="q")
                        )
                        sent += 1
        rate = (done - base) / (time.perf_counter() - t0)
        cpu_ms = (_cpu_s(worker.proc.pid) - cpu0) / (done - base) * 1000
    finally:
        worker.close()
    ideal = concurrency / latency_s
    print(
        f"slow provider ({latency_s * 1000:.0f} ms a call, {concurrency} concurrent turns, "
        f"one process): {rate:.0f} turns/s = {rate / ideal:.2f} of the ideal {ideal:.0f}; "
        f"worker {cpu_ms:.2f} ms CPU a turn"
    )
    return rate / ideal


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--history", type=int, default=40)
    parser.add_argument("--turns", type=int, default=1280)
    parser.add_argument("--latency", type=float, default=0.2)
    parser.add_argument("--repeat", type=int, default=1, help="slow-provider repetitions")
    parser.add_argument("--skip-cpu", action="store_true")
    args = parser.parse_args()
    if not args.skip_cpu:
        with fake_llm() as base_url:
            await client_cpu(base_url, args.calls, args.history)
    server = RedisServer().start()
    try:
        with fake_llm(args.latency) as base_url:
            ratios = [
                await slow_provider(server.url, base_url, args.turns, args.latency)
                for _ in range(args.repeat)
            ]
        if len(ratios) > 1:
            print(
                f"  ratio min/median/max {min(ratios):.2f} / {statistics.median(ratios):.2f} / "
                f"{max(ratios):.2f}"
            )
    finally:
        server.cleanup()


if __name__ == "__main__":
    os.environ.setdefault("AGENT_LOG_LEVEL", "WARNING")
    asyncio.run(main())
