"""What a hostile frontend of channel ``web`` costs the honest channel ``telegram``
(issue 12's reproductions, with figures): one real redis-server, one ``agent-worker run``
process (a local OpenAI-compatible server that answers at once), and per attack:

- ``markers``: N stop markers queued at the head of one web session, then a message;
- ``hint``: N queued web messages while the hint is re-set again and again;
- ``junk``: N empty streams, N hints and N index members written by web, then 10
  telegram messages whose notification was lost (time until all are answered);
- ``flood``: N control PUBLISHes on web's channel while a telegram turn is blocked:
  telegram's stop latency and the worker's RSS growth.

Printed per attack: telegram's ask latency while the attack runs (p50 / p99 / max),
the longest script call Redis logged (SLOWLOG, > 1 ms), and what is specific to it.

    python bench/isolation.py [--scale 100000] [--only markers,hint,junk,flood]
                              [--worker-src PATH]  # run the worker of another checkout
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import redis.asyncio as aioredis
from _common import RedisServer, summary
from fake_llm import FakeLLM  # tests/ is on sys.path (see _common)

from bus_redis import FrontendClient, InboundMessage, Keys

K = Keys()
HERE = Path(__file__).resolve()


def _msg(channel: str, chat: str, text: str, **kw: object) -> InboundMessage:
    return InboundMessage(channel=channel, sender_id="u", chat_id=chat, content=text, **kw)  # type: ignore[arg-type]


class Worker:
    def __init__(self, url: str, llm: FakeLLM, src: Path) -> None:
        env = {
            **os.environ,
            "AGENT_REDIS_URL": url,
            "AGENT_WORKER_ID": "bench-iso",
            "AGENT_PROVIDER": "openai",
            "AGENT_MODEL": "fake",
            "OPENAI_BASE_URL": llm.base_url,
            "OPENAI_API_KEY": "x",
            "AGENT_CHANNELS": "web,telegram",
            "AGENT_LOG_LEVEL": "WARNING",
            "PYTHONPATH": str(src),
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "worker.cli.main", "run"],
            cwd=src,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def probe(telegram: FrontendClient, stop: asyncio.Event, out: list[float]) -> None:
    """Telegram asks, one after the other, until ``stop``."""
    i = 0
    while not stop.is_set():
        i += 1
        t0 = time.perf_counter()
        await telegram.ask(_msg("telegram", f"p{i % 20}", f"ping {i}"), timeout_s=300)
        out.append((time.perf_counter() - t0) * 1000)


async def slowest_script_ms(admin: aioredis.Redis) -> float:
    entries = await admin.slowlog_get(1000)
    return max((e["duration"] / 1000 for e in entries), default=0.0)


async def attack_markers(admin: aioredis.Redis, web: FrontendClient, n: int) -> str:
    session = "web:markers"
    for start in range(0, n, 10_000):
        async with admin.pipeline(transaction=False) as pipe:
            for _ in range(min(10_000, n - start)):
                pipe.xadd(K.inbound(session), {"control": "stop"})
                pipe.incr(K.control_hint(session))
            await pipe.execute()
    t0 = time.perf_counter()
    await web.ask(_msg("web", "markers", "after"), timeout_s=600)
    return f"web's message after {n} markers answered in {(time.perf_counter() - t0):.2f} s"


async def attack_hint(admin: aioredis.Redis, web: FrontendClient, n: int) -> str:
    session = "web:longq"
    for start in range(0, n, 10_000):
        async with admin.pipeline(transaction=False) as pipe:
            for i in range(start, min(n, start + 10_000)):
                body = _msg("web", "longq", f"q{i}", id=f"q{i}").model_dump_json(exclude_none=True)
                pipe.xadd(K.inbound(session), {"payload": body})
            await pipe.execute()
    await admin.xadd(K.ready("web"), {"session": session})
    t0 = time.perf_counter()
    resets = 0
    while time.perf_counter() - t0 < 10:
        await admin.incrby(K.control_hint(session), 1)
        resets += 1
        await asyncio.sleep(0.005)
    left = await admin.xlen(K.inbound(session))
    return f"{resets} hint re-sets in 10 s; {n - left} of {n} web messages answered meanwhile"


async def attack_junk(admin: aioredis.Redis, telegram: FrontendClient, n: int) -> str:
    for start in range(0, n, 10_000):
        async with admin.pipeline(transaction=False) as pipe:
            for i in range(start, min(n, start + 10_000)):
                pipe.xadd(K.inbound(f"web:junk{i}"), {"x": "1"}, maxlen=0)
                pipe.incr(K.control_hint(f"web:hint{i}"))
                pipe.zadd(K.queued("web"), {f"web:none{i}": 0})
            await pipe.execute()
    stranded = [_msg("telegram", f"s{i}", f"stranded {i}") for i in range(10)]
    t0 = time.perf_counter()
    async with admin.pipeline(transaction=True) as pipe:
        for m in stranded:
            pipe.xadd(K.inbound(m.session_key), {"payload": m.model_dump_json(exclude_none=True)})
            pipe.zadd(K.queued("telegram"), {m.session_key: 0}, nx=True)
        await pipe.execute()
    times = []
    for m in stranded:
        try:
            await asyncio.wait_for(anext(telegram.events([m.session_key], after="0")), 120)
            times.append(time.perf_counter() - t0)
        except TimeoutError:
            break
    junk = 0
    async for _ in admin.scan_iter(match="agent:{web}:in:web:junk*", count=1000):
        junk += 1
    return (
        f"{len(times)}/10 stranded telegram messages answered, last after "
        f"{max(times, default=float('nan')):.1f} s; {junk} of {n} empty web streams left"
    )


FLOODER = """
import json, sys, redis
r = redis.Redis.from_url(sys.argv[1])
n = int(sys.argv[2])
body = json.dumps({"v": 2, "op": "stop", "session_key": "web:x"})
for start in range(0, n, 5000):
    pipe = r.pipeline(transaction=False)
    for i in range(5000):
        pipe.publish("agent:{web}:control", body.replace("web:x", f"web:f{start + i}"))
    pipe.execute()
"""


async def attack_flood(
    admin_url: str, telegram: FrontendClient, llm: FakeLLM, worker: Worker, n: int
) -> str:
    before = worker.rss_mb()
    llm.rearm()
    blocked = asyncio.create_task(
        telegram.ask(_msg("telegram", "blocked", "block me"), timeout_s=120)
    )
    await asyncio.to_thread(llm.started.wait, 30)
    # the flood comes from another process, as a hostile frontend's would
    flooder = subprocess.Popen([sys.executable, "-c", FLOODER, admin_url, str(n)])  # noqa: ASYNC220
    await asyncio.sleep(0.5)
    t0 = time.perf_counter()
    await telegram.stop("telegram:blocked")
    ev = await blocked
    stop_ms = (time.perf_counter() - t0) * 1000
    await asyncio.to_thread(flooder.wait)
    llm.release()
    await asyncio.sleep(1)
    return (
        f"telegram stop -> {ev.code} in {stop_ms:.0f} ms during the flood; worker RSS "
        f"{before:.0f} -> {worker.rss_mb():.0f} MB after {n} controls"
    )


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=int, default=100_000)
    ap.add_argument("--only", default="markers,hint,junk,flood")
    ap.add_argument("--worker-src", type=Path, default=HERE.parents[1])
    args = ap.parse_args()
    for name in args.only.split(","):
        server = RedisServer(extra=["--slowlog-log-slower-than", "1000"]).start()
        llm = FakeLLM().start()
        admin = aioredis.from_url(server.url, decode_responses=True)
        await admin.sadd("agent:channels", "web", "telegram")
        worker = Worker(server.url, llm, args.worker_src)
        telegram = FrontendClient(aioredis.from_url(server.url, decode_responses=True))
        web = FrontendClient(aioredis.from_url(server.url, decode_responses=True))
        try:
            await telegram.ask(_msg("telegram", "warm", "warm up"), timeout_s=60)
            await admin.slowlog_reset()
            stop, lat = asyncio.Event(), []  # type: ignore[var-annotated]
            probing = asyncio.create_task(probe(telegram, stop, lat)) if name != "flood" else None
            if name == "markers":
                what = await attack_markers(admin, web, args.scale)
            elif name == "hint":
                what = await attack_hint(admin, web, args.scale)
            elif name == "junk":
                what = await attack_junk(admin, telegram, args.scale)
            else:
                what = await attack_flood(server.url, telegram, llm, worker, args.scale)
            stop.set()
            if probing:
                await probing
            slow = await slowest_script_ms(admin)
            lat_s = summary(lat) + f"  max {max(lat):.0f} ms" if lat else "n/a"
            print(f"{name:8s} telegram asks: {lat_s}; slowest call {slow:.0f} ms\n         {what}")
        finally:
            worker.stop()
            llm.stop()
            await admin.aclose()
            server.cleanup()


if __name__ == "__main__":
    asyncio.run(main())
