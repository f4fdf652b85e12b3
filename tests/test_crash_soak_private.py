"""A kill -9 soak of private sessions: three real workers own six private sessions, each
asked six questions one after another (``FrontendClient.ask``), while a seeded random
killer SIGKILLs an owner of a session with questions to come each time six more were
answered, three times. A private session dies with its worker (README), so what is
checked is how it dies: every ask gets its one terminal event (never a wait run out); a
session answered after a question went unanswered never is (no conversation started
afresh on its key); an answered question was asked inside its own conversation (the
model saw the first question); and no worker keeps, nor any owner record names, a
session whose owner died."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import pytest
from replies import collect, until

from bus_redis import FrontendClient, InboundMessage, Keys

pytestmark = [pytest.mark.real_redis, pytest.mark.slow]
ENV = {"AGENT_LOCK_TTL_MS": "1000", "AGENT_OWNER_TTL_MS": "1500", "AGENT_CHANNELS": "web"}
SESSIONS, ASKS, WORKERS, KILLS, EVERY = 6, 6, 3, 3, 6


def _q(s: int, i: int) -> str:
    return f"[p{s}] question {i} of p{s}"


async def test_private_sessions_die_cleanly_under_random_kills(
    real_redis, spawn_workers, fake_llm
) -> None:  # type: ignore[no-untyped-def]
    fake_llm.latency_s = (0.005, 0.03)
    rng = random.Random(20261205)
    live: list[Any] = spawn_workers(WORKERS, env=ENV)
    client = FrontendClient(real_redis)
    keys = []
    for s in range(SESSIONS):
        key, opened = await client.open_transient("web", f"p{s}", session_key=f"web:p{s}-private")
        await collect(client, "web", {opened}, timeout_s=20)
        keys.append(key)
    codes: dict[int, list[str | None]] = {s: [] for s in range(SESSIONS)}
    answered = asyncio.Event()

    async def asker(s: int) -> None:
        for i in range(ASKS):
            msg = InboundMessage(
                id=f"p{s}-{i}", channel="web", sender_id="u", chat_id=f"p{s}",
                content=_q(s, i), session_key_override=keys[s], require_existing_session=True,
            )  # fmt: skip
            ev = await client.ask(msg, timeout_s=30)
            codes[s].append(ev.code)
            answered.set()

    askers = asyncio.gather(*(asker(s) for s in range(SESSIONS)))
    for n in range(KILLS):
        while sum(map(len, codes.values())) < EVERY * (n + 1) and not askers.done():
            answered.clear()
            await answered.wait()
        # a random owner of a private session with questions still to come (a worker
        # owning none would test nothing: the openings may all have gone to one worker)
        waiting = [k for s, k in enumerate(keys) if len(codes[s]) < ASKS]  # asks to come
        owners = {await real_redis.hget(Keys().owner(k), "worker") for k in waiting} - {None}
        doomed = [i for i, w in enumerate(live) if w.worker_id in owners] or list(range(len(live)))
        victim = live.pop(rng.choice(doomed))
        victim.kill()
        assert await asyncio.to_thread(victim.proc.wait, 30) == -9
        live += spawn_workers(1, env=ENV)
    await askers

    for s, got in codes.items():
        assert len(got) == ASKS, (s, got)
        ended = next((i for i, c in enumerate(got) if c is not None), ASKS)
        assert all(c in ("session_lost", "session_not_active") for c in got[ended:]), (s, got)
        for i in range(1, ended):  # answered: asked in its own conversation
            [request] = [
                r for r in fake_llm.requests if r["messages"][-1].get("content") == _q(s, i)
            ]
            assert _q(s, 0) in json.dumps(request), (s, i)
    assert any(c is not None for got in codes.values() for c in got)  # some died

    async def settled() -> bool:  # owner records name live workers only, and match them
        owners = [await real_redis.hget(Keys().owner(k), "worker") for k in keys]
        alive = {w.worker_id for w in live}
        if any(o is not None and o not in alive for o in owners):
            return False
        for w in live:
            info = await real_redis.hgetall(Keys().worker_info(w.worker_id))
            if info.get("transient") != str(owners.count(w.worker_id)):
                return False
        return True

    await until(settled, timeout_s=20)
