"""One user floods a gateway replica; what another user of it sees.

One ``agent-gateway`` process on its own redis-server (no worker: nothing is consumed).
``--processes`` processes of user ``alice`` (16 keep-alive connections each) post messages
to her chat as fast as the gateway answers, for ``--seconds``; meanwhile ``bob`` asks one request every 50 ms
(``GET /api/sessions``, a read of his chat list: within the default rate) and his
latency is recorded. Run with
the per-user rate (``AGENT_GATEWAY_USER_RATE`` / ``_BURST``, gateway.ratelimit) off and
at its default, in the same invocation, alternating ``--repeat`` times. Printed per
setting: alice's requests a second and how they were answered, bob's p50/p99, the
gateway's and redis-server's CPU a second.

    python bench/flood.py [--processes 2] [--seconds 5] [--repeat 2]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import sys
import time

import httpx
import redis.asyncio as aioredis
from _common import RedisServer, percentile
from gateways import GatewayProcess

ALICE = {"Authorization": "Bearer flood-alice-token"}
CONNECTIONS = 16  # per flooding process
BOB_EVERY_S = 0.05  # bob asks 20 times a second at most: within the default rate
BOB = {"Authorization": "Bearer flood-bob-token"}


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _redis_cpu(redis: aioredis.Redis) -> float:
    info = await redis.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


async def run(url: str, rate: str, processes: int, seconds: float) -> str:
    redis = aioredis.from_url(url)
    await redis.flushall()
    await redis.sadd("agent:channels", "web")
    gw = GatewayProcess(
        url,
        name="flood-gw",
        env={
            "AGENT_GATEWAY_TOKENS": "flood-alice-token=alice,flood-bob-token=bob",
            "AGENT_GATEWAY_USER_RATE": rate,
            "AGENT_LOG_LEVEL": "WARNING",
            "AGENT_GATEWAY_LOG_LEVEL": "WARNING",
        },
    )
    try:
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
            chat = (await http.post("/api/sessions", json={}, headers=ALICE)).json()["id"]
            children = [
                await asyncio.create_subprocess_exec(
                    sys.executable,
                    __file__,
                    "--child",
                    gw.url,
                    chat,
                    str(seconds + 1),
                    stdout=asyncio.subprocess.PIPE,
                )
                for _ in range(processes)
            ]
            await asyncio.sleep(0.5)  # the flood under way
            gw_cpu, redis_cpu, t0 = _cpu_s(gw.proc.pid), await _redis_cpu(redis), time.monotonic()
            bob: list[float] = []
            while time.monotonic() - t0 < seconds:
                start = time.perf_counter()
                r = await http.get("/api/sessions", headers=BOB)
                bob.append((time.perf_counter() - start) * 1000)
                assert r.status_code == 200, r.status_code
                await asyncio.sleep(BOB_EVERY_S)  # a user within the rate
            wall = time.monotonic() - t0
            gw_cpu, redis_cpu = _cpu_s(gw.proc.pid) - gw_cpu, await _redis_cpu(redis) - redis_cpu
            answers: collections.Counter[str] = collections.Counter()
            for child in children:
                out, _ = await child.communicate()
                answers.update(json.loads(out))
            span = seconds + 1  # the children's own span (their counts cover all of it)
    finally:
        gw.close()
        await redis.aclose()
    asked = sum(answers.values())
    how = ", ".join(f"{code}: {n / span:,.0f}" for code, n in sorted(answers.items()))
    return (
        f"alice {asked / span:,.0f} requests/s ({how})  "
        f"bob p50 {percentile(bob, 0.5):.1f} ms  p99 {percentile(bob, 0.99):.1f} ms  "
        f"gateway CPU {gw_cpu / wall:.2f}  Redis CPU {redis_cpu / wall:.2f} (cores)"
    )


async def child(base: str, chat: str, seconds: float) -> None:
    """A flooder: CONNECTIONS keep-alive connections, each posting as soon as the last
    answer came (a raw HTTP/1.1 client: cheap, so that the gateway is what is measured)."""
    host, port = base.removeprefix("http://").split(":")
    body = b'{"content": "x"}'
    request = (
        f"POST /api/sessions/{chat}/messages HTTP/1.1\r\nHost: gw\r\n"
        f"Authorization: {ALICE['Authorization']}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    answers: collections.Counter[str] = collections.Counter()
    end = time.monotonic() + seconds

    async def connection() -> None:
        """Posts over one connection; when the gateway closes it (a 429 of the rate
        closes its connection), connects again, as a flooder would."""
        while time.monotonic() < end:
            reader, writer = await asyncio.open_connection(host, int(port))
            try:
                while time.monotonic() < end:
                    writer.write(request)
                    head = await reader.readuntil(b"\r\n\r\n")
                    length = int(re.search(rb"(?i)content-length: *(\d+)", head)[1])  # type: ignore[index]
                    await reader.readexactly(length)
                    answers[head.split(b" ", 2)[1].decode()] += 1
                    if re.search(rb"(?i)\r\nconnection: *close", head):
                        break
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

    await asyncio.gather(*(connection() for _ in range(CONNECTIONS)))
    print(json.dumps(answers))


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--processes", type=int, default=2, help="flooding processes")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=5)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    if args.child:
        await child(args.child[0], args.child[1], float(args.child[2]))
        return
    server = RedisServer().start()
    try:
        for _ in range(args.repeat):
            for rate in ("0", "20"):
                line = await run(server.url, rate, args.processes, args.seconds)
                print(f"user rate {rate:>2}: {line}", flush=True)
    finally:
        server.cleanup()


if __name__ == "__main__":
    asyncio.run(main())
