"""Seeded random sequences of messages and controls on one session, durable or private,
in per-session or unified mode, against one or two real worker loops, on fakeredis and a
real redis-server. Whatever the
timing, the README's rules hold (README: Stop, discard or delete; Double texting):

- every message gets exactly one terminal event (its own, or one that ``covers`` it); a
  ``delete`` or ``new`` (of a private session: any end) takes the answers written before
  its marker was reached, but never the cancelled answers of what it covered;
- ``cancelled`` only for a message followed in the stream by a control (its marker covers
  exactly what was before it) or by an ``interrupt`` message;
- a message followed by neither is answered by the model (of a private session that
  ended before it: ``session_not_active``);
- a message whose model call was held when a control came is cancelled by it, and a turn
  under way when an ``interrupt`` message of its session comes is cancelled by that;
- the stored history (per-session mode) holds only messages after the last ``delete`` or
  ``new``, each once, in the order sent, every one of them that was answered among them;
- nothing is left behind (lease, pending set, journal, queued entry).

With two workers, a plan may restart a worker: gracefully, or, on the real server, as a
kill -9 leaves it (its connections cut, through a proxy, before its tasks are cancelled:
nothing of its shutdown reaches Redis). The survivor takes a stored chat's turns over; a
private session owned by that worker ends (README: its worker gone): what was sent before
may have no answer of its own (the unsolicited ``session_lost`` ends it) or a
``session_lost`` one, and what is sent after gets ``session_not_active``.

Waits are on answers only: after a control (or an interrupt) the test waits for the
answers of the held turns it must cut before it releases anything."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import uuid
from dataclasses import dataclass, field
from typing import Any

import fakeredis
import pytest
import redis.asyncio as aioredis
from helpers import ScriptedProvider
from proxies import RedisProxy
from replies import collect, no_leftovers, open_private, until

from bus_redis import FrontendClient, InboundMessage, Keys, OutboundMessage, RedisBus
from worker import AgentLoop, LoopConfig
from worker.agent.providers import LLMResponse

CONTROLS = ("stop", "discard", "delete", "new")
ENDS_PRIVATE = ("discard", "delete", "new")
WIPES = ("delete", "new")
FOLLOWUPS = (None, "queue", "inject", "interrupt", "interrupt")
K = Keys()
SEEDS = int(os.environ.get("SEQ_SEEDS", "6"))  # (more, to hunt: SEQ_SEEDS=200)

Op = tuple[str, Any]


@dataclass
class Sent:
    n: int  # its place in the plan
    id: str
    text: str
    held: bool  # (False also when it never reaches the model: a private session ended)
    cut_by: str = ""  # the control or "interrupt" that came while it was held


@dataclass
class Model:
    """Answers ``re: <last user text>``; while a text in ``holds`` is among the user
    messages it answers (those after its last answer: messages that joined come
    together), it waits for their release."""

    holds: dict[str, asyncio.Event] = field(default_factory=dict)
    holding: set[str] = field(default_factory=set)  # (held model calls under way)

    async def __call__(self, **kw: Any) -> LLMResponse:
        asked: list[str] = []
        for m in reversed(kw["messages"]):
            if m.get("role") != "user":
                break
            asked.append(str(m.get("content")))
        held = [text for text in asked if text in self.holds]
        self.holding.update(held)
        try:
            for text in held:
                await self.holds[text].wait()
        finally:
            self.holding.difference_update(held)
        return LLMResponse(content=f"re: {asked[0] if asked else None}")

    def release_all(self) -> None:
        for event in self.holds.values():
            event.set()

    def held(self, sent: list[Sent], *, running: bool) -> list[Sent]:
        """Held messages not released nor cut yet (``running``: in their model call)."""
        return [
            s
            for s in sent
            if s.held
            and not s.cut_by
            and not self.holds[s.text].is_set()
            and (s.text in self.holding or not running)
        ]


def _plan(seed: int) -> list[Op]:
    rng = random.Random(seed)
    ops: list[Op] = []
    for i in range(rng.randint(6, 14)):
        roll = rng.random()
        if roll < 0.04:
            ops.append(("restart", rng.randrange(2)))  # (two workers, stored chats only)
        elif roll < 0.2:
            ops.append(("running", None))
        elif roll < 0.65:
            held = rng.random() < 0.4
            ops.append(("send", (f"{'hold' if held else 'm'}-{i}", rng.choice(FOLLOWUPS))))
        elif roll < 0.82:
            ops.append(("control", rng.choice(CONTROLS)))
        else:
            ops.append(("release", None))
    return ops


@dataclass
class Run:
    ops: list[Op]
    private: bool
    sent: list[Sent] = field(default_factory=list)
    got: dict[str, list[OutboundMessage]] = field(default_factory=dict)
    stored: dict[str, Any] = field(default_factory=dict)
    ends: list[int] = field(default_factory=list)  # restarts that ended the private session

    def lost(self, s: Sent) -> bool:
        """Whether the private session's worker went after ``s`` was sent."""
        return any(e > s.n for e in self.ends)

    def later(self, s: Sent) -> list[Op]:
        return self.ops[s.n + 1 :]

    def wiped(self, s: Sent) -> bool:
        """Whether a later marker may take its answer (never a cancelled one)."""
        ends = WIPES + (ENDS_PRIVATE if self.private else ())
        return self.lost(s) or any(op == "control" and arg in ends for op, arg in self.later(s))

    def ended_before(self, n: int) -> bool:
        """A private session's message after its end: ``session_not_active``."""
        earlier = self.ops[:n]
        ended = any(op == "control" and a in ENDS_PRIVATE for op, a in earlier)
        return self.private and (ended or any(e < n for e in self.ends))


@dataclass
class Scene:
    """The workers, the model and the frontend of one run."""

    redis_factory: Any
    config: LoopConfig
    model: Model = field(default_factory=Model)
    loops: list[AgentLoop] = field(default_factory=list)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    upstream: int = 0  # the real server's port (0: fakeredis, no kill -9)
    proxies: dict[int, RedisProxy] = field(default_factory=dict)  # id(loop) -> its proxy
    clients: list[aioredis.Redis] = field(default_factory=list)

    async def start(self, workers: int) -> None:
        for _ in range(workers):
            self.loops.append(await self._worker())
            self.tasks.append(asyncio.create_task(self.loops[-1].run()))

    async def _worker(self) -> AgentLoop:
        provider = ScriptedProvider(handler=self.model)
        config = self.config.model_copy(update={"worker_id": f"w-{uuid.uuid4().hex[:8]}"})
        if not self.upstream:
            return AgentLoop(RedisBus(self.redis_factory()), provider, config=config)
        proxy = RedisProxy(self.upstream)
        redis = aioredis.from_url(await proxy.start(), decode_responses=True)
        self.clients.append(redis)
        loop = AgentLoop(RedisBus(redis), provider, config=config)
        self.proxies[id(loop)] = proxy
        return loop

    def victim(self, i: int, crash: bool) -> int:
        """The worker a restart takes: ``i``; for a crash, the one running a turn, if
        one is (its turn must be taken over)."""
        if crash:
            i = next((j for j, loop in enumerate(self.loops) if loop.active_tasks), i)
        return i

    async def restart(self, i: int, *, crash: bool = False) -> None:
        """A graceful stop of worker ``i`` (its turns cut, run again by the other), or
        its crash (``crash``: Redis sees it as a kill -9 leaves it), and a new worker in
        its place."""
        proxy = self.proxies.get(id(self.loops[i]))
        if crash and proxy is not None:
            proxy.cut()  # nothing it does from now on reaches Redis
            self.tasks[i].cancel()
            await asyncio.wait({self.tasks[i]}, timeout=15)
        else:
            self.loops[i].stop()
            await asyncio.wait_for(self.tasks[i], 15)
        self.loops[i] = await self._worker()
        self.tasks[i] = asyncio.create_task(self.loops[i].run())

    async def stop(self) -> None:
        self.model.release_all()
        for loop in self.loops:
            loop.stop()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.gather(*self.tasks, return_exceptions=True), 15)
        for client in self.clients:
            await client.aclose()


async def _run(
    redis_factory: Any, seed: int, workers: int, mode: str, private: bool, unified: bool
) -> Run:
    config = LoopConfig(
        read_block_ms=50,
        followup_mode=mode,  # type: ignore[arg-type]
        unified_session=unified,
        shutdown_grace_s=0.05,  # (a held turn is cut by a restart and runs elsewhere)
        # a killed owner's private session ends when its record runs out (the owners'
        # sweep, each tick: a third of the lease): 3 s here, not 15
        lock_ttl_ms=2_000,
        owner_ttl_ms=3_000,
    )
    probe = redis_factory()  # (the real server's port: its workers may be killed)
    real = not isinstance(probe, fakeredis.FakeAsyncRedis)
    upstream = int(probe.connection_pool.connection_kwargs["port"]) if real else 0
    scene = Scene(redis_factory, config, upstream=upstream)
    await scene.start(workers)
    model = scene.model
    client = FrontendClient(redis_factory())
    chat, key = f"s{seed}", f"web:s{seed}"
    route: dict[str, Any] = {"channel": "web", "sender_id": "u", "chat_id": chat}
    run = Run(_plan(seed), private)
    try:
        if private:
            key = await open_private(client, chat)
            route |= {"session_key_override": key, "require_existing_session": True}
        for n, (op, arg) in enumerate(run.ops):
            if op == "send":
                text, followup = arg
                if text.startswith("hold"):
                    model.holds[text] = asyncio.Event()
                held = text in model.holds and not run.ended_before(n)
                running = model.held(run.sent, running=True)
                msg = InboundMessage(id=f"{seed}-{n}", content=text, followup=followup, **route)
                await client.send(msg)
                run.sent.append(Sent(n, msg.id, text, held))
                if followup == "interrupt" and running:  # it cancels the turn it came into
                    await _cut(client, running, "interrupt")
            elif op == "control":
                held = model.held(run.sent, running=False)
                await client.control(arg, key)
                await _cut(client, held, arg)  # (covered by its marker)
            elif op == "running":
                await _some_turn_held(client, model, run.sent)
            elif op == "restart" and workers == 2:
                await _restart(scene, run, client.redis, key, (seed, n, arg))
            elif op == "release":
                model.release_all()
        model.release_all()
        kept = {s.id for s in run.sent if not run.wiped(s)}
        await collect(client, "web", kept, timeout_s=30)
        await no_leftovers(client.redis, [key])
        run.got = await collect(client, "web", set(), timeout_s=0)
        if not private and not unified:
            run.stored = await scene.loops[0].sessions.read_session(key) or {}
    finally:
        await scene.stop()
        await client.aclose()
    return run


async def _restart(
    scene: Scene, run: Run, redis: aioredis.Redis, key: str, at: tuple[int, int, int]
) -> None:
    """The plan's restart ``n`` of worker ``i``: a kill -9 or a graceful stop, drawn apart
    from the plan (whose seeds stay as they were); a private session its worker owned
    ends with it."""
    seed, n, i = at
    crash = random.Random(f"crash-{seed}-{n}").random() < 0.5
    i = scene.victim(i, crash)
    owner = await redis.hget(K.owner(key), "worker") if run.private else None
    if owner == scene.loops[i].rt.worker_id:
        run.ends.append(n)
        for s in run.sent:  # (no control cuts them: they are lost)
            s.held = False
    await scene.restart(i, crash=crash)


async def _cut(client: FrontendClient, held: list[Sent], by: str) -> None:
    """Wait for the answers of the held messages ``by`` must cut, before anything is
    released (a release beating the pub/sub message would let a running one end first,
    as it may)."""
    for s in held:
        s.cut_by = by
    await collect(client, "web", {s.id for s in held}, timeout_s=20)


async def _some_turn_held(client: FrontendClient, model: Model, sent: list[Sent]) -> None:
    """Until a held model call is under way, or every held message not released has its
    answer (the earliest unanswered message always runs: if it is held, it holds)."""
    waiting = model.held(sent, running=False)
    if not waiting:
        return

    async def held_or_answered() -> bool:
        if model.holding:
            return True
        got = await collect(client, "web", set(), timeout_s=0)
        return all(any(e.is_terminal for e in got.get(s.id, [])) for s in waiting)

    await until(held_or_answered, timeout_s=20)


def _check_answers(run: Run, where: str) -> None:
    for s in run.sent:
        terminals = [e for e in run.got.get(s.id, []) if e.is_terminal]
        assert len(terminals) == 1 or (run.wiped(s) and not terminals), f"{s.id}; {where}"
        if not terminals:
            continue
        ev, later = terminals[0], run.later(s)
        if ev.code == "session_lost":
            assert run.lost(s), f"{s.id} lost, yet its session's worker stayed; {where}"
        if run.lost(s) and ev.code in ("session_lost", "session_not_active"):
            continue  # (or read after the end: not active)
        controlled = any(op == "control" for op, _ in later)
        interrupted = any(op == "send" and arg[1] == "interrupt" for op, arg in later)
        if ev.code == "cancelled":
            assert controlled or interrupted, f"{s.id} cancelled by nothing; {where}"
        elif run.ended_before(s.n):
            assert ev.code == "session_not_active", f"{s.id}: {ev}; {where}"
        elif not controlled and not interrupted:
            assert ev.type == "message", f"{s.id}: {ev.type} {ev.code} {ev.content}; {where}"
        if s.cut_by:  # by it, or by an interrupt heard before its turn had loaded
            assert ev.code == "cancelled", f"{s.id} held, yet {ev.type}; {where}"
            by = {s.cut_by} | ({"interrupt"} if interrupted else set())
            assert any(b in ev.content for b in by), f"{s.id}: {ev.content}, {by}; {where}"


def _check_history(run: Run, where: str) -> None:
    last_wipe = max(
        (n for n, (op, arg) in enumerate(run.ops) if op == "control" and arg in WIPES),
        default=-1,
    )
    messages = run.stored.get("messages", [])
    users = [m.get("content") for m in messages if m.get("role") == "user"]
    order = [s.text for s in run.sent if s.n > last_wipe]
    assert len(users) == len(set(users)), f"a user row twice: {users}; {where}"
    assert all(u in order for u in users), f"rows from before a wipe: {users}; {where}"
    assert users == sorted(users, key=order.index), f"rows out of order: {users}; {where}"
    answered = [
        s.text
        for s in run.sent
        if s.n > last_wipe and any(e.type == "message" and e.is_terminal for e in run.got[s.id])
    ]
    assert set(answered) <= set(users), f"answered, not stored: {answered} {users}; {where}"


@pytest.mark.parametrize("kind", ["durable", "private", "unified", "unified-private"])
@pytest.mark.parametrize("mode", ["inject", "queue"])
@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("seed", range(SEEDS))
async def test_controls_and_followups_keep_the_readme_rules(
    redis_factory, seed: int, workers: int, mode: str, kind: str
) -> None:  # type: ignore[no-untyped-def]
    run = await _run(redis_factory, seed, workers, mode, "private" in kind, "unified" in kind)
    where = f"seed {seed}, {workers} worker(s), {mode}, {kind}: {run.ops}"
    _check_answers(run, where)
    if kind == "durable":
        _check_history(run, where)
