"""The gateway's event fan-out with many open SSE streams, against a real redis-server.

One ``agent-gateway`` process (under its generated ACL user) serves ``--streams`` open SSE
streams (one chat each, spread over 50 users). Events are written into the chats' event streams with ``XADD``
exactly as a worker writes them, and read back two ways in the same run:

- through the gateway: the SSE clients (one asyncio process, httpx);
- directly: one ``XREAD BLOCK`` over the same streams, as a frontend with its own Redis
  client would.

Printed: events/s through the gateway (a burst of ``--burst`` events spread over the
streams), added latency (XADD -> SSE receipt vs XADD -> direct read, p50/p99, events
paced so neither path is saturated), the gateway's memory per open stream (RSS before and
after opening them) and its Redis connections (``CLIENT LIST`` of its user).

    python bench/gateway.py [--streams 1000] [--burst 5000] [--paced 500]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from typing import Any

import httpx
import redis.asyncio as aioredis
from _common import RedisServer, percentile
from gateways import GatewayProcess

from bus_redis import OutboundMessage
from bus_redis.acl import gateway_acl
from bus_redis.keys import Keys

USERS = 50  # the streams are spread over this many users (a user may hold 64 per process)
K = Keys()


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def until(predicate: Any, timeout_s: float) -> None:
    deadline = time.perf_counter() + timeout_s
    while not predicate() and time.perf_counter() < deadline:
        await asyncio.sleep(0.01)


def payload(chat_id: str, sent_ns: int) -> dict[str, str]:
    doc = OutboundMessage(
        type="delta",
        channel="web",
        chat_id=chat_id,
        session_key=f"web:{chat_id}",
        reply_to="m",
        content=str(sent_ns),
    )
    return {"payload": doc.model_dump_json()}


async def follow(
    http: httpx.AsyncClient,
    base: str,
    chat: str,
    ticket: str,
    ready: asyncio.Event,
    received: list[tuple[str, int]],
) -> None:
    url = f"{base}/api/sessions/{chat}/events?ticket={ticket}"
    async with http.stream("GET", url) as r:
        async for line in r.aiter_lines():
            if line.startswith(":"):
                ready.set()
            elif line.startswith("data:"):
                received.append((chat, time.perf_counter_ns()))


async def direct_reader(
    redis: aioredis.Redis, chats: list[str], stop: asyncio.Event, received: list[tuple[str, int]]
) -> None:
    position = {K.out(f"web:{c}"): "$" for c in chats}
    position = {
        k: (await redis.xrevrange(k, "+", "-", count=1) or [("0-0",)])[0][0] for k in position
    }
    while not stop.is_set():
        reply = await redis.xread(position, block=200, count=1000)
        now = time.perf_counter_ns()
        for stream, batch in reply or []:
            position[stream] = batch[-1][0]
            received.extend((stream, now) for _ in batch)


async def main(args: argparse.Namespace) -> None:
    server = RedisServer(extra=["--maxclients", "20000"]).start()
    admin = aioredis.from_url(server.url, decode_responses=True)
    for line in gateway_acl("web", "bench-gw-pw"):
        await admin.execute_command(*line.split())
    host = server.url.removeprefix("redis://")
    gw = GatewayProcess(
        f"redis://gateway-web:bench-gw-pw@{host}",
        name="bench-gw",
        env={
            "AGENT_GATEWAY_TOKENS": ",".join(f"bench-token-{u:04d}=user{u}" for u in range(USERS)),
            "AGENT_GATEWAY_MAX_SESSIONS_PER_USER": "100000",
            "AGENT_LOG_LEVEL": "WARNING",
            "AGENT_GATEWAY_LOG_LEVEL": "WARNING",
        },
    )
    headers = [{"Authorization": f"Bearer bench-token-{u:04d}"} for u in range(USERS)]
    limits = httpx.Limits(max_connections=args.streams + 50, max_keepalive_connections=50)
    try:
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            chats = [
                (
                    await http.post(f"{gw.url}/api/sessions", json={}, headers=headers[i % USERS])
                ).json()["id"]
                for i in range(args.streams)
            ]
            tickets = [
                (await http.post(f"{gw.url}/api/tickets", headers=h)).json()["ticket"]
                for h in headers
            ]
            rss_before = rss_kib(gw.proc.pid)
            received: list[tuple[str, int]] = []
            readies = [asyncio.Event() for _ in chats]
            tasks = [
                asyncio.create_task(follow(http, gw.url, c, tickets[i % USERS], e, received))
                for i, (c, e) in enumerate(zip(chats, readies, strict=True))
            ]
            t0 = time.perf_counter()
            for e in readies:
                await asyncio.wait_for(e.wait(), 120)
            opened_s = time.perf_counter() - t0
            await asyncio.sleep(1.0)  # let the gateway settle before measuring memory
            rss_after = rss_kib(gw.proc.pid)
            clients = [c for c in await admin.client_list() if c.get("user") == "gateway-web"]
            print(
                f"{args.streams} SSE streams open in {opened_s:.1f} s; gateway RSS "
                f"{rss_before / 1024:.1f} -> {rss_after / 1024:.1f} MiB = "
                f"{(rss_after - rss_before) / args.streams:.1f} KiB per open stream; "
                f"Redis connections of the gateway: {len(clients)}"
            )

            # throughput: a burst spread over every stream, XADDs pipelined
            received.clear()
            t0, cpu0 = time.perf_counter(), cpu_s(gw.proc.pid)
            async with admin.pipeline(transaction=False) as pipe:
                for i in range(args.burst):
                    chat = chats[i % len(chats)]
                    pipe.xadd(K.out(f"web:{chat}"), payload(chat, 0))
                    pipe.xadd(K.pulse("web"), {"o": K.out(f"web:{chat}")})  # as workers do
                await pipe.execute()
            await until(lambda: len(received) >= args.burst, 120)
            burst_s = time.perf_counter() - t0
            burst_cpu = cpu_s(gw.proc.pid) - cpu0
            print(
                f"burst: {len(received)}/{args.burst} events through the gateway in "
                f"{burst_s:.2f} s = {len(received) / burst_s:,.0f} events/s; gateway CPU "
                f"{burst_cpu * 1e6 / max(1, len(received)):.0f} us per event"
            )

            # latency: paced events, gateway and direct reader side by side
            received.clear()
            direct: list[tuple[str, int]] = []
            stop = asyncio.Event()
            reader = aioredis.from_url(server.url, decode_responses=True)
            direct_task = asyncio.create_task(direct_reader(reader, chats, stop, direct))
            await asyncio.sleep(0.3)
            sent: dict[str, list[int]] = {}
            cpu0, t0 = cpu_s(gw.proc.pid), time.perf_counter()
            for i in range(args.paced):
                chat = chats[(i * 7919) % len(chats)]
                now = time.perf_counter_ns()
                async with admin.pipeline(transaction=True) as pipe:  # as workers do
                    pipe.xadd(K.out(f"web:{chat}"), payload(chat, now))
                    pipe.xadd(K.pulse("web"), {"o": K.out(f"web:{chat}")})
                    await pipe.execute()
                sent.setdefault(chat, []).append(now)
                await asyncio.sleep(0.004)
            await until(lambda: len(received) >= args.paced and len(direct) >= args.paced, 10)
            paced_cpu = cpu_s(gw.proc.pid) - cpu0
            print(
                f"paced: {args.paced} events in {time.perf_counter() - t0:.1f} s; gateway CPU "
                f"{paced_cpu * 1e6 / args.paced:.0f} us per event "
                f"({paced_cpu / (time.perf_counter() - t0):.0%} of a core)"
            )
            stop.set()
            await direct_task
            await reader.aclose()
            via_gw = _latencies(sent, received, key=lambda c: c)
            via_redis = _latencies(sent, direct, key=lambda s: s.rsplit(":", 1)[-1])
            print(
                f"latency XADD -> SSE receipt ({len(via_gw)} events): p50 "
                f"{percentile(via_gw, 0.5):.2f} ms, p99 {percentile(via_gw, 0.99):.2f} ms"
            )
            print(
                f"latency XADD -> direct XREAD ({len(via_redis)} events): p50 "
                f"{percentile(via_redis, 0.5):.2f} ms, p99 {percentile(via_redis, 0.99):.2f} ms"
            )
            print(
                f"added by the gateway: p50 {percentile(via_gw, 0.5) - percentile(via_redis, 0.5):+.2f} ms, "
                f"p99 {percentile(via_gw, 0.99) - percentile(via_redis, 0.99):+.2f} ms"
            )
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        gw.close()
        await admin.aclose()
        server.cleanup()


def _latencies(sent: dict[str, list[int]], got: list[tuple[str, int]], key: Any) -> list[float]:
    """Match each receipt to the oldest unmatched send of its chat."""
    queues = {c: list(v) for c, v in sent.items()}
    out = []
    for name, at in got:
        q = queues.get(key(name))
        if q:
            out.append((at - q.pop(0)) / 1e6)
    return out or [float("nan")]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--burst", type=int, default=5000)
    parser.add_argument("--paced", type=int, default=500)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    asyncio.run(main(parser.parse_args()))
