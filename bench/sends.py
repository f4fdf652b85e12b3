"""What a message sent through the gateway costs: ``POST /api/sessions/{id}/messages``.

In one process (httpx over ASGI, so the CPU figure includes the HTTP client's), against
an own redis-server: one user sends ``--sends`` messages round-robin over ``--chats`` of
their chats (nothing consumes them; ``AGENT_GATEWAY_MAX_WAITING_PER_CHAT`` is raised so
that none is refused). Printed, min / median / max over ``--repeat`` runs: CPU per send,
latency p50 / p99, Redis commands per send (``INFO commandstats``).

    python bench/sends.py [--sends 2000] [--chats 8] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# bench/gateway.py is a script, not the gateway package: import the package first
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
import httpx  # noqa: E402
import redis.asyncio as aioredis  # noqa: E402

from gateway.app import Gateway, create_app  # noqa: E402
from gateway.settings import GatewaySettings  # noqa: E402

sys.path.append(str(HERE))
from _common import RedisServer, percentile  # noqa: E402

TOKEN = "bench-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def run(url: str, sends: int, chats: int) -> tuple[float, float, float, float]:
    def make() -> aioredis.Redis:
        return aioredis.from_url(url, decode_responses=True)

    admin = make()
    await admin.flushall()
    config = GatewaySettings(tokens={TOKEN: "bench"}, max_waiting_per_chat=10**6)
    gw = Gateway(config, make(), [make()])
    app = create_app(config, gw)
    gw.hub.start()
    app.state.gw = gw
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            ids = [
                (await http.post("/api/sessions", json={}, headers=AUTH)).json()["id"]
                for _ in range(chats)
            ]
            for sid in ids:  # warm: every chat has a title and a waiting entry
                await http.post(
                    f"/api/sessions/{sid}/messages", json={"content": "w"}, headers=AUTH
                )
            await admin.config_resetstat()
            latencies = []
            cpu = time.process_time()
            for i in range(sends):
                start = time.perf_counter()
                r = await http.post(
                    f"/api/sessions/{ids[i % chats]}/messages", json={"content": "q"}, headers=AUTH
                )
                latencies.append(time.perf_counter() - start)
                assert r.status_code == 202, r.text
            cpu = time.process_time() - cpu
            stats = await admin.info("commandstats")
            calls = sum(
                int(v["calls"])
                for k, v in stats.items()
                if k not in ("cmdstat_config", "cmdstat_info")
            )
    finally:
        await gw.hub.stop()
        await admin.aclose()
    return (
        cpu / sends * 1e6,
        percentile(latencies, 0.5) * 1e3,
        percentile(latencies, 0.99) * 1e3,
        calls / sends,
    )


def spread(values: list[float], fmt: str) -> str:
    return " / ".join(format(v, fmt) for v in (min(values), statistics.median(values), max(values)))


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sends", type=int, default=2000)
    parser.add_argument("--chats", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    server = RedisServer().start()
    try:
        runs = [await run(server.url, args.sends, args.chats) for _ in range(args.repeat)]
    finally:
        server.cleanup()
    print(f"{args.sends} sends over {args.chats} chats of one user, {args.repeat} runs:")
    print(f"  CPU per send       {spread([r[0] for r in runs], '.0f')} µs (HTTP client included)")
    print(f"  latency p50        {spread([r[1] for r in runs], '.2f')} ms")
    print(f"  latency p99        {spread([r[2] for r in runs], '.2f')} ms")
    print(f"  Redis commands     {spread([r[3] for r in runs], '.1f')} per send")


if __name__ == "__main__":
    asyncio.run(main())
