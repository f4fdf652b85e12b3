"""The turn path against its floor: ``agent-worker run`` processes next to a minimal fenced
Lua turn loop (``bench/baseline_loop.py``), under the same closed-loop load, in one run.

    python bench/baseline.py [--repeat 5] [--procs 1,2,4] [--loop-procs 1] [--sessions 100]
                             [--turns 4000] [--history 0] [--warm 5]

Each repetition runs, on a fresh redis-server database, in turn: the baseline loop (with
``--loop-procs``, also 2, 4 copies of it sharing the queue), then 1, 2, 4 worker processes
(echo provider); the load is ``--sessions`` sessions with one
message in flight each (a session sends its next message when its answer arrives, each
send a task of its own, as a gateway's requests are), through the real frontend client, after a warm-up of ``--warm`` turns per session and worker process (so
that every process's session cache holds every session: a steady state, not the first
load of each session by each process). Printed per system:
turns/s and its ratio to the baseline of the same repetition (and, for N processes with
``--loop-procs`` N, to the loop as N processes, and that ratio over one process's ratio in
the same repetition: how the worker scales next to the loop), CPU per turn of the serving
processes, of redis-server (``INFO cpu``) and of the load generator (this process), and
Redis commands per turn (``INFO commandstats``: every client, commands run inside scripts
included) with the script calls among them, and the cores the three kept busy (their CPU
seconds over the window's wall seconds: a system already near the machine's core count
cannot gain from another process, one that leaves cores idle can), and how often a serving
process' event loop gave the CPU up to wait (its next wake-up starts with cold caches) or
was preempted, per turn; min / median / max over repetitions. With
``--commandstats N``, each system's N costliest commands by Redis time per turn.

With ``--floor``, ``bench/bus_floor.py`` runs too, after the loop: the worker's own lease and
commit scripts and bus driven as the loop drives its own, with no worker around them
(what the scripts cost, apart from what the worker's turn path adds); one worker process's
turns/s is then also given over the floor's, per repetition.

With ``--plain-loop``, the loop runs a second time with its two scripts sent through
redis-py's own client (``register_script``, its connection pool), as a loop is written
the ordinary way and as issue 15 measured its yardstick; one worker process's turns/s is
then also given over it, per repetition. The loop itself (``loop``) uses the worker's
multiplexed connection, so that it pays what the worker pays per command.

With ``--apart``, N worker processes run as N deployments on the one redis-server (key
prefixes ``w0`` .. ``wN-1``, the sessions dealt among them, one frontend client each): no
session, queue or session cache is shared, so what N processes on the cores cost shows
apart from what sharing the sessions costs (every system then reads its answers through
one merged feed, 1 process too).

Turns/s counts the answers the load generator read; the serving side's and Redis' costs
are per turn served (the replies written in the window: the channel pulse's
``entries-added``), the load generator's per answer read. The two counts differ when the
reader falls behind for a while (thousands of sessions, a short window): ``served / read``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from pathlib import Path

import redis.asyncio as aioredis
from _common import RedisServer
from workers import WorkerProcess  # tests/ is on sys.path (see _common)

from bus_redis import FrontendClient, InboundMessage, Keys, OutboundMessage
from session_store import RedisSessionStore, Session

BENCH = Path(__file__).resolve().parent
CHANNEL = "base"


@dataclass
class Run:
    rate: float
    serve_ms: float  # CPU of the serving processes per turn
    redis_us: float
    front_ms: float
    commands: float
    scripts: float
    per_command: dict[str, tuple[float, float]]  # name -> (calls, Redis µs) per turn
    served: float  # turns served in the window / answers the load generator read in it
    cores: float  # CPU seconds of serving, Redis and the load generator per second of wall
    blocked: float  # the serving processes' main threads: waits that gave the CPU up, a turn
    preempted: float  # ... and times the kernel took the CPU from them, a turn


async def _commandstats(redis: aioredis.Redis) -> dict[str, tuple[int, int]]:
    stats = await redis.info("commandstats")
    return {k.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"])) for k, v in stats.items()}


def _switches(pid: int) -> tuple[int, int]:
    """Context switches of the process' main thread (its event loop): voluntary (it
    waited), involuntary (preempted)."""
    counts = dict.fromkeys(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"), 0)
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in counts:
            counts[name] = int(value)
    return counts["voluntary_ctxt_switches"], counts["nonvoluntary_ctxt_switches"]


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _redis_counts(redis: aioredis.Redis, prefixes: list[str]) -> tuple[float, int, int, int]:
    """Redis CPU, commands, script calls, and the replies written so far (both systems add
    one pulse entry per reply; ``entries-added`` counts those trimmed away too)."""
    cpu = await redis.info("cpu")
    stats = await redis.info("commandstats")
    calls = sum(int(v["calls"]) for v in stats.values())
    scripts = sum(
        int(v["calls"]) for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval")
    )
    replies = 0
    for prefix in prefixes:
        replies += int((await redis.xinfo_stream(Keys(prefix).pulse(CHANNEL)))["entries-added"])
    cpu_s = float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"])
    return cpu_s, calls, scripts, replies


class _Serving:
    """The processes that answer: the baseline loop, or ``agent-worker run`` x n."""

    def __init__(self, url: str, system: str, prefixes: list[str]) -> None:
        self.system = system
        if system.endswith("loop") or system == "floor":  # "N loop": N loops, one queue
            n = int(system.split()[0]) if system[0].isdigit() else 1
            script = "bus_floor.py" if system == "floor" else "baseline_loop.py"
            plain = ["plain"] if system == "plain loop" else []
            self.procs = [
                subprocess.Popen(
                    [sys.executable, str(BENCH / script), url, CHANNEL, f"base{i}", *plain],
                    cwd=BENCH.parent,
                )
                for i in range(n)
            ]
            self.workers: list[WorkerProcess] = []
        else:
            env = {
                "AGENT_PROVIDER": "echo",
                "AGENT_LOG_LEVEL": "WARNING",
                "AGENT_CONCURRENCY": "64",
                "AGENT_JOBS": "local",
                "AGENT_CHANNELS": CHANNEL,
            }
            n = int(system.split()[0])
            self.workers = [
                WorkerProcess(
                    url,
                    worker_id=f"b{i}",
                    env={**env, "AGENT_KEY_PREFIX": prefixes[i % len(prefixes)]},
                )
                for i in range(n)
            ]
            self.procs = [w.proc for w in self.workers]

    def cpu_s(self) -> float:
        return sum(_cpu_s(p.pid) for p in self.procs)

    def switches(self) -> tuple[int, int]:
        each = [_switches(p.pid) for p in self.procs]
        return sum(v for v, _ in each), sum(n for _, n in each)

    def close(self) -> None:
        for w in self.workers:
            w.close()
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


async def _preload(redis: aioredis.Redis, sessions: int, rows: int, prefixes: list[str]) -> None:
    """Every session starts with ``rows`` rows of history (both systems' own formats)."""
    for s in range(sessions):
        store = RedisSessionStore(redis, Keys(prefixes[s % len(prefixes)]))
        key = f"{CHANNEL}:c{s}"
        session = Session(key=key, scope=f"{CHANNEL}/sender:u")
        for i in range(rows):
            session.add_message("user" if i % 2 == 0 else "assistant", f"earlier message {i}")
        await store.save(session)
        history = f"{Keys().prefix}:base:history:{key}"
        await redis.rpush(history, *(json.dumps(m) for m in session.messages))


async def _merged(
    fronts: list[FrontendClient], chats: list[str]
) -> AsyncGenerator[tuple[int, OutboundMessage], None]:
    """Every frontend's events of its share of ``chats`` (session i is frontend i mod n's),
    as one feed: (which frontend, event)."""
    feed: asyncio.Queue[tuple[int, OutboundMessage]] = asyncio.Queue()

    async def pump(i: int) -> None:
        mine = chats[i :: len(fronts)]
        async for ev in fronts[i].events(mine, after="0", block_ms=2000):
            await feed.put((i, ev))

    pumps = [asyncio.create_task(pump(i)) for i in range(len(fronts))]
    try:
        while True:
            yield await feed.get()
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


async def _single(
    front: FrontendClient, chats: list[str]
) -> AsyncGenerator[tuple[int, OutboundMessage], None]:
    async for ev in front.events(chats, after="0", block_ms=2000):
        yield 0, ev


async def run(
    url: str,
    system: str,
    sessions: int,
    turns: int,
    history: int = 0,
    warm_rounds: int = 5,
    apart: bool = False,
) -> Run:
    redis = aioredis.from_url(url, decode_responses=True)
    await redis.flushall()
    procs = 1 if system.endswith("loop") or system == "floor" else int(system.split()[0])
    prefixes = [f"w{i}" for i in range(procs)] if apart and system.endswith("proc") else ["agent"]
    if history:
        await _preload(redis, sessions, history, prefixes)
    await redis.config_resetstat()
    fronts = [FrontendClient(redis, prefix) for prefix in prefixes]
    serving = _Serving(url, system, prefixes)
    chats = [f"{CHANNEL}:c{s}" for s in range(sessions)]
    # warm: every worker process has served every session (its cache holds it) with all
    # but ~0.3% odds at 5 turns per session and process; the loop keeps no cache
    warm = sessions * warm_rounds * procs
    done = 0
    mark: tuple[float, float, float, float, int, int, int] | None = None
    switched = (0, 0)
    before: dict[str, tuple[int, int]] = {}
    # each answer's next message is sent by a task of its own, as a gateway's requests are:
    # sending them one after the other from the reading loop would pace every system by
    # the load generator's round trips, not by its own cost
    sends: set[asyncio.Task[str]] = set()
    failed: list[BaseException] = []

    def _sent(task: asyncio.Task[str]) -> None:
        sends.discard(task)
        if not task.cancelled() and task.exception() is not None:
            failed.append(task.exception())  # type: ignore[arg-type]

    try:
        for s in range(sessions):
            await fronts[s % len(fronts)].send(
                InboundMessage(channel=CHANNEL, sender_id="u", chat_id=f"c{s}", content="q")
            )
        # as a frontend following many sessions reads: blocked on the channel's pulse,
        # reading the streams it names (bus_redis.pulse)
        feed = _merged(fronts, chats) if apart else _single(fronts[0], chats)
        async for i, ev in feed:
            if failed:
                raise failed[0]
            if ev.type not in ("message", "error"):
                continue
            done += 1
            if done == warm:
                mark = (
                    time.perf_counter(),
                    time.process_time(),
                    serving.cpu_s(),
                    *await _redis_counts(redis, prefixes),
                )
                before = await _commandstats(redis)
                switched = serving.switches()
            if done >= turns + warm:
                break
            chat = ev.session_key.partition(":")[2]
            sending = asyncio.create_task(
                fronts[i].send(
                    InboundMessage(channel=CHANNEL, sender_id="u", chat_id=chat, content="q")
                )
            )
            sends.add(sending)
            sending.add_done_callback(_sent)
        assert mark is not None
        wall = time.perf_counter() - mark[0]
        front = time.process_time() - mark[1]
        serve = serving.cpu_s() - mark[2]
        blocked, preempted = (b - a for a, b in zip(switched, serving.switches(), strict=True))
        await feed.aclose()
        redis_cpu, calls, scripts, replies = await _redis_counts(redis, prefixes)
        after = await _commandstats(redis)
    finally:
        for task in list(sends):
            task.cancel()
        await asyncio.gather(*sends, return_exceptions=True)
        serving.close()
        await redis.aclose()
    read = done - warm
    # costs per turn served (replies written in the window): with many sessions the reader
    # may fall behind for a while, and a window's turns served and answers read differ
    n = replies - mark[6]
    return Run(
        rate=read / wall,
        serve_ms=serve / n * 1000,
        redis_us=(redis_cpu - mark[3]) / n * 1e6,
        front_ms=front / read * 1000,
        commands=(calls - mark[4]) / n,
        scripts=(scripts - mark[5]) / n,
        served=n / read,
        cores=(serve + redis_cpu - mark[3] + front) / wall,
        blocked=blocked / n,
        preempted=preempted / n,
        per_command={
            name: ((c - before.get(name, (0, 0))[0]) / n, (u - before.get(name, (0, 0))[1]) / n)
            for name, (c, u) in after.items()
        },
    )


def _spread(values: list[float], fmt: str) -> str:
    return " / ".join(format(v, fmt) for v in (min(values), statistics.median(values), max(values)))


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--procs", default="1,2,4", help="worker process counts")
    parser.add_argument(
        "--loop-procs", default="1", help="loop process counts (e.g. 1,2,4: the loop scaled too)"
    )
    parser.add_argument("--sessions", type=int, default=100)
    parser.add_argument("--turns", type=int, default=4000, help="measured turns per run")
    parser.add_argument("--history", type=int, default=0, help="rows each session starts with")
    parser.add_argument(
        "--warm", type=int, default=5, help="warm-up turns per session and worker process"
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also run bench/bus_floor.py: the worker's scripts and bus driven as the loop "
        "drives its own (where the gap is: scripts and bus, or the worker's turn path)",
    )
    parser.add_argument(
        "--plain-loop",
        action="store_true",
        help="also run the loop with its two scripts sent through redis-py's own client "
        "(register_script, its pool) instead of the multiplexed connection: the yardstick "
        "as issue 15 measured it; one worker process's turns/s is then also given over it",
    )
    parser.add_argument(
        "--apart",
        action="store_true",
        help="N worker processes as N deployments sharing nothing but redis-server",
    )
    parser.add_argument(
        "--commandstats",
        type=int,
        default=0,
        metavar="N",
        help="also print each system's N costliest Redis commands (calls and Redis µs per "
        "turn, the last repetition; a script's inner commands are counted on their own too)",
    )
    args = parser.parse_args()
    loops = ["loop" if n == "1" else f"{n} loop" for n in args.loop_procs.split(",")]
    if "loop" not in loops:
        loops.insert(0, "loop")
    systems = [
        *loops,
        *(["plain loop"] if args.plain_loop else []),
        *(["floor"] if args.floor else []),
        *(f"{n} proc" for n in args.procs.split(",")),
    ]
    runs: dict[str, list[Run]] = {s: [] for s in systems}
    ratios: dict[str, list[float]] = {s: [] for s in systems}
    server = RedisServer().start()
    try:
        for rep in range(args.repeat):
            for system in systems:  # alternating, same server, fresh database
                r = await run(
                    server.url,
                    system,
                    args.sessions,
                    args.turns,
                    args.history,
                    args.warm,
                    apart=args.apart,
                )
                runs[system].append(r)
                ratios[system].append(r.rate / runs["loop"][rep].rate)
                print(f"  rep {rep + 1} {system:10} {r.rate:7.0f} turns/s", flush=True)
    finally:
        server.cleanup()
    print(
        f"\n{args.sessions} sessions of {args.history}+ rows, one message in flight each, "
        f"{args.turns} turns a run, "
        f"{args.repeat} repetitions: min / median / max"
    )
    for system in systems:
        rs = runs[system]
        print(f"{system}:")
        print(f"  turns/s            {_spread([r.rate for r in rs], '.0f')}")
        print(f"  ratio to the loop  {_spread(ratios[system], '.2f')}")
        twin = f"{system.split()[0]} loop"  # the loop with as many processes, if it ran
        if system.endswith("proc") and twin in runs:
            same = [r.rate / t.rate for r, t in zip(rs, runs[twin], strict=True)]
            print(f"  ratio to {twin:6}    {_spread(same, '.2f')}")
            if system != "1 proc" and "1 proc" in runs:  # issue 15's item 3, per repetition
                one = ratios["1 proc"]
                scaling = [x / y for x, y in zip(same, one, strict=True)]
                print(f"  that / 1 proc's    {_spread(scaling, '.2f')} (same repetition)")
        if system == "1 proc" and "floor" in runs:  # the worker's gap over its own scripts
            floor = [r.rate / f.rate for r, f in zip(rs, runs["floor"], strict=True)]
            print(f"  ratio to floor     {_spread(floor, '.2f')} (same repetition)")
        if system == "1 proc" and "plain loop" in runs:  # against the issue's own yardstick
            plain = [r.rate / p.rate for r, p in zip(rs, runs["plain loop"], strict=True)]
            print(f"  ratio to plain     {_spread(plain, '.2f')} (same repetition)")
        cpu = [loop.serve_ms / r.serve_ms for r, loop in zip(rs, runs["loop"], strict=True)]
        print(f"  loop's CPU / this  {_spread(cpu, '.2f')} (serving CPU per turn)")
        print(f"  serving CPU/turn   {_spread([r.serve_ms * 1000 for r in rs], '.0f')} µs")
        print(f"  Redis CPU/turn     {_spread([r.redis_us for r in rs], '.0f')} µs")
        print(f"  frontend CPU/turn  {_spread([r.front_ms * 1000 for r in rs], '.0f')} µs")
        print(f"  Redis commands     {_spread([r.commands for r in rs], '.1f')} per turn")
        print(f"  of them scripts    {_spread([r.scripts for r in rs], '.1f')} per turn")
        print(f"  served / read      {_spread([r.served for r in rs], '.2f')}")
        busy = _spread([r.cores for r in rs], ".2f")
        print(f"  cores busy         {busy} of {os.cpu_count()} (all three together)")
        blocked = _spread([r.blocked for r in rs], ".2f")
        preempted = _spread([r.preempted for r in rs], ".2f")
        print(f"  serving waits      {blocked} a turn (its loop gave the CPU up; then cold)")
        print(f"  preempted          {preempted} a turn")
        top = sorted(rs[-1].per_command.items(), key=lambda kv: -kv[1][1])[: args.commandstats]
        for name, (calls, usec) in top:
            print(f"    {name:16} {calls:5.2f} calls {usec:7.1f} µs per turn")


if __name__ == "__main__":
    asyncio.run(main())
