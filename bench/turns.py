"""Throughput, latency, Redis round trips per turn, and cost vs history length.

    python bench/turns.py [--sessions 200] [--messages 10] [--workers 2]

Runs its own redis-server; workers are in-process AgentLoops with the echo provider, so
the figures are the worker's own cost (no LLM time). Latency is server-side: reply entry
time minus inbound entry time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

import redis.asyncio as aioredis
from _common import CountingRedis, RedisServer, summary
from workers import WorkerProcess  # tests/ is on sys.path (see _common)

from bus_redis import FrontendClient, InboundMessage, Keys, RedisBus
from bus_redis.codec import stream_id_ms
from session_store import Session
from worker import AgentLoop, LoopConfig
from worker.agent.providers import EchoProvider


def _round_trips(loops: list[AgentLoop]) -> int:
    """Commands through redis-py (counted by CountingRedis) and through the workers'
    multiplexed connections, the turn path's and the ready queues' reader (bus_redis.mux:
    each command one round trip, as before, though concurrent ones share a write)."""
    muxes = [m for loop in loops for m in (loop.bus.fast, loop.bus.reader) if m is not None]
    return CountingRedis.round_trips + sum(m.commands for m in muxes)


async def throughput(url: str, sessions: int, messages: int, workers: int) -> None:
    frontend = FrontendClient(aioredis.from_url(url, decode_responses=True))
    loops = [
        AgentLoop(
            RedisBus(CountingRedis.from_url(url, decode_responses=True)),
            EchoProvider(),
            config=LoopConfig(
                worker_id=f"bench-{i}",
                concurrency=64,
                read_block_ms=100,
                channels=["bench"],
                # a turn per message: queued messages would otherwise join a turn at its
                # last model boundary, and turns/s would count fewer, larger turns
                followup_mode="queue",
            ),
        )
        for i in range(workers)
    ]
    total = sessions * messages
    for n in range(messages):  # everything is queued before the workers start
        for s in range(sessions):
            msg = InboundMessage(
                id=f"s{s}-{n}", channel="bench", sender_id="u", chat_id=f"c{s}", content=f"m{n}"
            )
            await frontend.send(msg)
    rt0, cpu0, t0 = _round_trips(loops), time.process_time(), time.perf_counter()
    runs = [asyncio.create_task(loop.run()) for loop in loops]
    answered: set[str] = set()
    await _read_all(frontend, "bench", sessions, messages, answered)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    rts = _round_trips(loops) - rt0
    for loop in loops:
        loop.stop()
    await asyncio.gather(*runs)
    print(
        f"throughput: {total} turns, {sessions} sessions x {messages}, {workers} in-process workers"
    )
    print(f"  {total / wall:.0f} turns/s wall   {wall:.2f} s")
    print(f"  {cpu / total * 1000:.3f} ms CPU per turn (workers + reply reader, one process)")
    print(f"  {rts / total:.2f} worker round trips per turn (incl. queue reads, heartbeats)")


async def _read_all(
    frontend: FrontendClient, channel: str, sessions: int, messages: int, answered: set[str]
) -> float:
    """Read every session's event stream (XREAD from the last id seen) until each has
    ``messages`` answers; a complete session is no longer read, as a frontend stops
    following a finished chat. Returns the time of the first answer."""
    keys = Keys()
    position = {keys.out(f"{channel}:c{s}"): "0" for s in range(sessions)}
    per: dict[str, int] = dict.fromkeys(position, 0)
    first = 0.0
    while position:
        reply = await frontend.redis.xread(position, count=1000, block=200)  # type: ignore[arg-type]
        for stream, batch in reply or []:
            for eid, fields in batch:
                first = first or time.perf_counter()
                ev = json.loads(fields["payload"])
                answered.add(ev.get("reply_to") or "")
                position[stream] = eid
                if ev["type"] in ("message", "error"):  # one answer may cover several
                    per[stream] += len(ev.get("covers") or [None])
            if per[stream] >= messages:
                del position[stream]
    return first


async def throughput_processes(url: str, sessions: int, messages: int, workers: int) -> None:
    """The same load served by ``agent-worker run`` processes (one per core)."""
    redis = aioredis.from_url(url, decode_responses=True)
    await redis.flushall()
    frontend = FrontendClient(redis)
    total = sessions * messages
    for n in range(messages):
        for s in range(sessions):
            msg = InboundMessage(
                id=f"p{s}-{n}", channel="procs", sender_id="u", chat_id=f"c{s}", content=f"m{n}"
            )
            await frontend.send(msg)
    env = {
        **os.environ,
        "AGENT_PROVIDER": "echo",
        "AGENT_LOG_LEVEL": "WARNING",
        "AGENT_CONCURRENCY": "64",
        "AGENT_JOBS": "local",
        "AGENT_CHANNELS": "procs",
        "AGENT_FOLLOWUP_MODE": "queue",  # a turn per message (see throughput)
    }
    procs = [WorkerProcess(url, worker_id=f"bench-p{i}", env=env) for i in range(workers)]
    answered: set[str] = set()
    t0 = 0.0
    try:
        t0 = await _read_all(frontend, "procs", sessions, messages, answered)
        wall = time.perf_counter() - t0
    finally:
        for p in procs:
            p.close()
    print(f"throughput: {total} turns by {workers} worker processes")
    print(
        f"  {(total - 1) / wall:.0f} turns/s wall from the first reply to the last   {wall:.2f} s"
    )


async def latency(url: str, turns: int) -> None:
    """Sequential turns (no queueing): publish-to-reply latency measured on Redis' clock."""
    redis = aioredis.from_url(url, decode_responses=True)
    frontend = FrontendClient(redis)
    loop = AgentLoop(
        RedisBus(aioredis.from_url(url, decode_responses=True)),
        EchoProvider(),
        config=LoopConfig(worker_id="lat", read_block_ms=100, channels=["lat"]),
    )
    run = asyncio.create_task(loop.run())
    await asyncio.sleep(0.2)
    samples: list[float] = []
    # from the start of the (new) stream: "$" would be resolved at the first read, after
    # the first send, and could miss a reply written before it
    replies = frontend.events(["lat:one"], after="0", block_ms=200)
    for i in range(turns):
        entry = await frontend.send(
            InboundMessage(channel="lat", sender_id="u", chat_id="one", content=f"q{i}")
        )
        ev = await anext(replies)
        out_ms = await _reply_ms(redis)
        samples.append(float(out_ms - stream_id_ms(entry)) if out_ms else 0.0)
        assert ev.reply_to == entry
    loop.stop()
    await run
    print(f"latency (server clock, ms resolution), {turns} sequential turns: {summary(samples)}")


async def _reply_ms(redis: aioredis.Redis) -> int:
    info = await redis.xinfo_stream(Keys().out("lat:one"))
    return stream_id_ms(str(info["last-generated-id"]))


async def history_cost(url: str, sizes: list[int], turns: int) -> None:
    """Worker CPU and round trips per turn as the stored history grows."""
    print("cost vs history length (in-process process_message, echo provider):")
    for size in sizes:
        redis = CountingRedis.from_url(url, decode_responses=True)
        await redis.flushall()
        config = LoopConfig(worker_id="hist", consolidate_above_tokens=10**12)  # the turn alone
        loop = AgentLoop(RedisBus(redis), EchoProvider(), config=config)
        seed = Session(key="bench:h")
        seed.append_rows(
            [
                {"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i} " * 8}
                for i in range(size)
            ]
        )
        await loop.sessions.save(seed)
        msg = InboundMessage(channel="bench", sender_id="u", chat_id="h", content="warm")
        await loop.process_message(msg)  # loads the session into the cache once
        rt0, cpu0, t0 = _round_trips([loop]), time.process_time(), time.perf_counter()
        for i in range(turns):
            await loop.process_message(
                msg.model_copy(update={"content": f"turn {i}", "id": f"t{i}"})
            )
        cpu_ms = (time.process_time() - cpu0) / turns * 1000
        wall_ms = (time.perf_counter() - t0) / turns * 1000
        rts = (_round_trips([loop]) - rt0) / turns
        hash_len = await redis.hlen(Keys().session("bench:h"))
        print(
            f"  history {size:>6}: {cpu_ms:.3f} ms CPU/turn  {wall_ms:.3f} ms wall/turn  {rts:.1f} RT/turn  "
            f"(hash fields {hash_len})"
        )
        await redis.aclose()


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--messages", type=int, default=10)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--history", default="0,1000,10000,50000")
    args = parser.parse_args()
    server = RedisServer().start()
    try:
        await throughput(server.url, args.sessions, args.messages, args.workers)
        await throughput_processes(server.url, args.sessions, args.messages, args.workers)
        await latency(server.url, 300)
        await history_cost(server.url, [int(x) for x in args.history.split(",")], 300)
    finally:
        server.cleanup()
    print(json.dumps({"note": "figures are for this machine; see docs/ARCHITECTURE.md"}))


if __name__ == "__main__":
    asyncio.run(main())
