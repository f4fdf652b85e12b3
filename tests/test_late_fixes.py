"""A second reading of the latest fixes (a helper's, stop 52; its four failing tests failed
before their fixes): a body's cost by
its bytes and its JSON values, charged in two parts (``gateway/charge.py``); the
per-user catch-up turn (``gateway/hub.py``); the in-process turn's id
``(ms-1)-(2**64-1)`` (``worker/runtime/direct.py``); ``id_taken`` (maintenance)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from inprocess import cancelled, in_process_turn
from test_gateway_api import ALICE
from test_gateway_ratelimit import Clock, _gateway

# --- 1. a body's cost, charged in two parts ---------------------------------------------


def _csv_text(chars: int) -> str:
    """A pasted table of small numbers: a comma every other character."""
    return ("1," * (chars // 2))[:chars]


def _hash(name: str) -> str:
    from gateway.auth import User

    return User(name).hash


async def test_a_message_costing_more_than_the_burst_is_admitted_on_a_full_bucket(
    redis_factory: Any,
) -> None:
    """Promise (charge.py): a body costs by its bytes or its values, "at most the burst"
    (``UserRate.admit`` caps the cost), so a full bucket admits any request. But the cost
    is charged in two parts -- by Content-Length in ``Charge`` (2 tokens for a 100 KB
    body), then the rest in ``BodyLimit`` (``charge_rest``), each capped at the burst
    separately: a request's total is up to burst + its Content-Length part. A replica at 1
    request a second, burst 10: Alice, her bucket full, sends a message of the largest
    text allowed (100,000 characters, a pasted table: ~50,000 commas, 13 tokens by
    values): ``Charge`` takes 2, the rest asks for 10 of the 8 left, 2 s off: 429 with
    ``Retry-After: 2``. She waits that (her bucket full again) and sends it again: the
    same, for ever -- an honest message that can never be sent (had it been charged at
    once, capped at 10, a full bucket admits it)."""

    async with _gateway(redis_factory, user_rate=1, user_burst=10) as (http, gw):
        clock = Clock()
        gw.auth.rate.clock, gw.auth.rate.sleep = clock, clock.sleep  # type: ignore[method-assign]
        sid = (await http.post("/api/sessions", json={}, headers=ALICE)).json()["id"]
        clock.now += 60  # her bucket full
        body = json.dumps({"content": _csv_text(100_000)}).encode()
        headers = {**ALICE, "Content-Type": "application/json"}
        told: list[int] = []
        r = await http.post(f"/api/sessions/{sid}/messages", content=body, headers=headers)
        while r.status_code == 429 and sum(told) < 120:
            told.append(int(r.headers["retry-after"]))
            clock.now += max(told[-1], 10)  # she waits what she was told, and more (full)
            r = await http.post(f"/api/sessions/{sid}/messages", content=body, headers=headers)
        assert r.status_code == 202, (
            f"a 100,000-character message (the largest allowed) sent on a full bucket "
            f"(rate 1, burst 10) was refused {len(told)} times (told {told[:5]}...), "
            f"last answer {r.status_code}"
        )


async def test_the_commas_in_a_messages_text_are_not_charged_as_json_values(
    redis_factory: Any,
) -> None:
    """Promise (charge.py): a body costs by "the JSON values in it" (parsing them costs
    the event loop). But they are counted as the ``[``, ``{`` and ``,`` bytes of the body,
    inside strings too: the text of a message is one JSON value, however many commas it
    holds. At the defaults (20 a second, burst 100) a message of the largest text
    allowed, 100,000 characters, costs 2 tokens as prose and 13 as a pasted table of
    numbers (~50,000 commas) -- the same bytes, one string to parse; 8 such pastes in a
    row empty an honest user's bucket (and at a stricter rate one can never be sent:
    the test above)."""

    async with _gateway(redis_factory) as (http, gw):
        clock = Clock()
        gw.auth.rate.clock, gw.auth.rate.sleep = clock, clock.sleep  # type: ignore[method-assign]
        sid = (await http.post("/api/sessions", json={}, headers=ALICE)).json()["id"]
        headers = {**ALICE, "Content-Type": "application/json"}
        costs = {}
        for name, text in [("prose", "word " * 20_000), ("table", _csv_text(100_000))]:
            clock.now += 3600  # a full bucket
            before, _ = gw.auth.rate._level(_hash("alice"), clock.now)
            body = json.dumps({"content": text}).encode()
            r = await http.post(f"/api/sessions/{sid}/messages", content=body, headers=headers)
            assert r.status_code == 202, r.text
            after, _ = gw.auth.rate._level(_hash("alice"), clock.now)
            costs[name] = before - after
        assert costs["table"] == costs["prose"], (
            f"one 100,000-character text costs {costs['prose']:g} tokens as prose and "
            f"{costs['table']:g} as a table of numbers (its commas counted as JSON values)"
        )


# --- 2. one catch-up read at a time per user ---------------------------------------------


@pytest.mark.parametrize("seed", range(3))
async def test_cancelled_catch_up_readers_leave_no_share_behind_and_the_rest_proceed(
    redis: Any, seed: int
) -> None:
    """Held: 24 catch-up reads of one user and 8 of another's, piled up behind a slow
    Redis; some cancelled at random (holding their turn, or waiting for it: the user's
    or the process's); the rest all finish, never more than 1 of a user's and 4 in all
    at once, each with the right events; no per-user entry is left behind, and a read
    afterwards is served at once."""
    import random

    from bus_redis import OutboundMessage
    from bus_redis.keys import Keys
    from gateway.hub import EventHub

    rnd = random.Random(seed)
    keys = Keys()
    session = "web:chat-1"
    stream = keys.out(session)
    ids = []
    for i in range(20):
        doc = OutboundMessage(type="message", channel="web", chat_id="chat-1",
                              session_key=session, reply_to=f"m{i}", content=f"e{i}")  # fmt: skip
        ids.append(await redis.xadd(stream, {"payload": doc.model_dump_json()}))
    hub = EventHub([redis], redis, keys, channel="web", wake_key="wk", max_streams=100)
    real_xread = redis.xread
    gate = asyncio.Event()
    inside: dict[str, int] = {}
    peak = {"a": 0, "b": 0, "all": 0}
    import contextvars

    current: contextvars.ContextVar[str] = contextvars.ContextVar("owner")

    async def slow_xread(*args: Any, **kwargs: Any) -> Any:
        owner = current.get()
        inside[owner] = inside.get(owner, 0) + 1
        peak[owner] = max(peak[owner], inside[owner])
        peak["all"] = max(peak["all"], sum(inside.values()))
        try:
            await gate.wait()
            return await real_xread(*args, **kwargs)
        finally:
            inside[owner] -= 1

    hub.redis = type("R", (), {"xread": staticmethod(slow_xread)})()  # type: ignore[assignment]

    async def read(owner: str, after: int) -> tuple[str, list[str]]:
        current.set(owner)
        events, _ = await hub.read_after(stream, ids[after], 16, 0, owner)
        return owner, [ev.entry_id for ev in events]

    plan = [("a", rnd.randrange(19)) for _ in range(24)] + [
        ("b", rnd.randrange(19)) for _ in range(8)
    ]
    rnd.shuffle(plan)
    tasks = [asyncio.create_task(read(o, a)) for o, a in plan]
    for _ in range(5):
        await asyncio.sleep(0)
    cancelled = set(rnd.sample(range(len(tasks)), 12))
    for i in cancelled:
        tasks[i].cancel()
    for _ in range(5):
        await asyncio.sleep(0)
    gate.set()
    done = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 20)
    for i, (result, (owner, after)) in enumerate(zip(done, plan, strict=True)):
        if i in cancelled and isinstance(result, asyncio.CancelledError):
            continue
        assert not isinstance(result, BaseException), result
        assert result == (owner, ids[after + 1 : after + 17])
    assert peak["a"] <= 1, peak
    assert peak["b"] <= 1, peak
    assert peak["all"] <= 4, peak
    assert hub._users_catching_up == {}
    current.set("a")
    events, _ = await asyncio.wait_for(hub.read_after(stream, ids[0], 16, 0, "a"), 5)
    assert len(events) == 16
    assert hub._users_catching_up == {}


# --- 3. the in-process turn's id (ms-1)-(2**64-1) ------------------------------------------


@pytest.mark.parametrize("older", [False, True])
async def test_a_stop_found_in_the_stream_by_markers_lua_cancels_anin_process_turn(
    redis: Any, make_loop: Any, monkeypatch: Any, older: bool
) -> None:
    """Held: a stop heard without its marker's id (``markers.lua`` reads the stream from
    the turn's id ``(ms-1)-(2**64-1)``: ``XRANGE (<ms-1>-18446744073709551615``), with an
    entry older than the turn in the stream or none, cancels the in-process turn, on
    fakeredis and on the real server."""
    from bus_redis import ControlMessage, FrontendClient, Keys

    keys = Keys()
    if older:
        await redis.xadd(keys.inbound("web:ms"), {"control": "stop"}, id="1-0")
    loop, turn = await in_process_turn(make_loop, monkeypatch, 0.0)
    client = FrontendClient(redis)
    async with redis.pipeline(transaction=True) as pipe:
        client.queue_control(pipe, "stop", "web:ms")
        await pipe.execute()
    loop.on_control(ControlMessage(op="stop", session_key="web:ms", marker=None))
    await cancelled(turn, "a stop found by markers.lua was ignored")


async def test_a_stop_sent_after_an_in_process_turn_began_cancels_it_whatever_the_hosts_clock(
    redis: Any, make_loop: Any, monkeypatch: Any
) -> None:
    """Promise (direct.py): "only controls published from now on" cancel the in-process
    turn -- its id is made of the *worker's* clock (``time.time()``), the marker's of
    Redis's (``XADD *``). A worker host whose clock is 1 s ahead of Redis's (the
    heartbeats are stamped with Redis's clock so that "hosts whose clocks differ are
    judged alike") takes every stop of the turn's first second for one before the turn
    and drops it (``Controls._by_marker``): the turn runs on. (Not new in 2dc4427; the
    window is the skew.)"""
    from bus_redis import FrontendClient

    _loop, turn = await in_process_turn(make_loop, monkeypatch, 1.0)
    await FrontendClient(redis).stop("web:ms")
    why = "a stop sent while the in-process turn ran was ignored (the host's clock 1 s ahead)"
    await cancelled(turn, why)


async def test_an_in_process_turn_running_as_the_loop_starts_keeps_its_lease(
    redis: Any, make_loop: Any, monkeypatch: Any
) -> None:
    """Promise (README, Embedding: ``process_message`` before or beside ``loop.run()``;
    direct.py: a turn "under the session's Redis lease"). Found while writing the tests
    above: a turn begun while the loop starts (``run()`` as a task, then
    ``process_message``, or a turn in flight when ``run()`` is called) has its lease
    taken by the start's ``sweeps.takeover(..., self.worker_id)`` ("leases still held
    under this worker id are a former life's"): the lease key is gone at once, and the
    turn is aborted with ``lease_lost`` at its first renewal (~3.4 s), its caller given
    ``TurnAbortedError`` instead of the reply."""
    from bus_redis import Keys

    loop, turn = await in_process_turn(make_loop, monkeypatch, 0.0, started=False)
    lease = Keys().lease("web:ms")
    held = await redis.get(lease)
    assert held is not None
    now = await redis.get(lease)
    try:
        async with asyncio.timeout(5):  # the start, and the turn's first renewal (~3.4 s)
            while now == held and not turn.done():
                await asyncio.sleep(0.02)
                now = await redis.get(lease)
    except TimeoutError:
        pass
    assert loop._consumer is not None  # the loop started meanwhile
    ended = turn.exception() if turn.done() and not turn.cancelled() else None
    turn.cancel()
    await asyncio.gather(turn, return_exceptions=True)
    assert now == held, f"the in-process turn's lease was {held!r}, once the loop started {now!r}"
    assert ended is None, f"the turn ended with {ended!r}"


# --- 4. id_taken: a healthy worker is not stopped ----------------------------------------


async def test_a_worker_whose_record_was_lost_or_expired_goes_on(
    redis: Any, make_loop: Any
) -> None:
    """Held: a running worker's record deleted (a Redis restarted without persistence, a
    record expired while the worker was slow) or rewritten without a claim: its next
    heartbeat writes it again and the worker serves on (``id_taken`` stays False)."""
    from helpers import ScriptedProvider

    from bus_redis import Keys

    loop = make_loop(ScriptedProvider(["x"]))
    async with asyncio.timeout(10):
        while loop._consumer is None:
            await asyncio.sleep(0.01)
    info = Keys().worker_info(loop.worker_id)
    mine = await redis.hget(info, "claim")
    assert mine
    await redis.delete(info)
    await loop.maintenance.heartbeat()
    assert not loop.maintenance.id_taken
    assert await redis.hget(info, "claim") == mine
    await redis.hdel(info, "claim")
    await loop.maintenance.heartbeat()
    assert not loop.maintenance.id_taken
    assert await redis.hget(info, "claim") == mine
