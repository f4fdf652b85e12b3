"""Nothing lost, nothing unfenced, nothing left behind: one test per defect of the
hardening issue (each fails on the code before it), on fakeredis and a real server."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from itertools import permutations
from typing import Any

import pytest
import redis.asyncio as aioredis
from helpers import ScriptedProvider
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from replies import channel_events, collect, until

from bus_redis import FrontendClient, InboundMessage, Keys, RedisBus
from bus_redis.registry import Registry
from bus_redis.results import Acquired, Ahead, Entry, Forward
from session_store import RedisSessionStore, Session, SessionManager
from worker import AgentLoop, LoopConfig
from worker.agent.providers import LLMResponse, ToolCallRequest

K = "web:h"


def _m(chat: str, text: str, **kw: Any) -> InboundMessage:
    return InboundMessage(channel="web", sender_id="u", chat_id=chat, content=text, **kw)


async def test_bytes_that_are_not_utf8_behind_a_running_turn_cost_nobody_else(
    redis_factory, make_loop
) -> None:  # type: ignore[no-untyped-def]
    """The follow-up pull meets the bad entry while a turn runs: the pull stops there, the
    running turn ends normally, the bad entry gets invalid_message once, the next runs."""
    client = FrontendClient(redis_factory())
    bad = b'{"v":2,"channel":"web","sender_id":"u","chat_id":"h","content":"\xff\xfe"}'
    calls = 0

    async def handler(**kw: Any) -> LLMResponse:
        nonlocal calls
        calls += 1
        if calls == 1:  # while the first turn runs, the bad entry and a good one arrive
            await client.send_raw(K, bad)
            await client.send(_m("h", "after", id="good"))
            return LLMResponse(tool_calls=[ToolCallRequest("c1", "create_goal", {"title": "g"})])
        last = kw["messages"][-1]
        return LLMResponse(content="done" if last["role"] == "tool" else f"re: {last['content']}")

    make_loop(ScriptedProvider(handler=handler))
    first = await client.send(_m("h", "first", id="first"))
    got = await collect(client, "web", {first, "good"})
    terminal = [e for evs in got.values() for e in evs if e.is_terminal]
    codes = sorted((e.reply_to, e.code or e.content) for e in terminal)
    assert ("first", "done") in codes
    assert ("good", "re: after") in codes
    assert [c for _, c in codes].count("invalid_message") == 1
    assert len(terminal) == 3


async def test_a_stop_while_the_session_loads_cancels_the_turn(redis_factory, make_loop) -> None:  # type: ignore[no-untyped-def]
    loading, proceed = asyncio.Event(), asyncio.Event()

    class SlowLoad(SessionManager):
        async def load_for_turn(
            self, key: str, version: int, generation: str = "", ahead: Ahead | None = None
        ) -> Session:
            loading.set()
            await proceed.wait()
            return await super().load_for_turn(key, version, generation, ahead)

    redis = redis_factory()
    provider = ScriptedProvider(handler=_echo)
    loop = make_loop(provider, sessions=SlowLoad(RedisSessionStore(redis, Keys())))
    client = FrontendClient(redis_factory())
    mid = await client.send(_m("l", "long"))
    await asyncio.wait_for(loading.wait(), 10)
    await client.stop("web:l")
    await until(lambda: loop.turns.reason("web:l") == "stop")  # the control is recorded
    proceed.set()
    got = await collect(client, "web", {mid})
    assert got[mid][-1].code == "cancelled"
    assert provider.calls == []  # the LLM was never called


async def test_the_sweep_serves_a_message_whose_notification_was_lost(
    redis_factory, make_loop
) -> None:  # type: ignore[no-untyped-def]
    """A message in its stream with no notification (never written, or trimmed away) is
    served within one sweep period (plus the in-flight grace)."""
    redis = redis_factory()
    make_loop(ScriptedProvider(handler=_echo), sweep_interval_ms=100, lock_ttl_ms=300)
    k = Keys()
    payload = _m("lost", "no notification", id="lost").model_dump_json()
    await redis.xadd(k.inbound("web:lost"), {"payload": payload})  # the MULTI's second half lost
    client = FrontendClient(redis_factory())
    trimmed = await client.send(_m("trim", "trimmed", id="trimmed"))
    await redis.xtrim(k.ready("web"), maxlen=0)  # a frontend wiped its own ready queue
    got = await collect(client, "web", {"lost", trimmed}, timeout_s=15)
    assert got["lost"][-1].content == "re: no notification"
    assert got[trimmed][-1].content == "re: trimmed"


@settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(order=st.sampled_from(list(permutations(["publish", "forward", "death"]))))
async def test_a_message_for_a_private_session_survives_its_owners_death(
    redis: aioredis.Redis, order: tuple[str, ...]
) -> None:
    """Any interleaving of publish / forward by another worker / owner death: afterwards
    the sweep and one acquire by a live worker select the message (so it is answered,
    session_not_active), never strand it."""
    await redis.flushall()
    bus, key = RedisBus(redis), "web:p"
    client, registry = FrontendClient(redis), Registry(bus)
    await bus.ensure_groups(bus.note_streams("w2", ["web"]))
    got = await bus.acquire(key, "w1", claim_owner=True, select=False)
    assert isinstance(got, Acquired)
    await bus.release(key, got.token)
    for step in order:
        if step == "publish":
            await client.send(
                _m("p", "hello", session_key_override=key, require_existing_session=True)
            )
        elif step == "forward":  # another worker takes the notification and forwards it
            for note in await bus.read_notifications(
                "w2", bus.note_streams("w2", ["web"]), count=10, block_ms=1
            ):
                result = await bus.acquire(key, "w2", member=key, note=note)
                if isinstance(result, Forward):
                    await bus.forward(result.owner, note)
                elif isinstance(result, Acquired):
                    await bus.release(key, result.token)
        else:  # the owner is gone: its record lapses
            await redis.delete(bus.keys.owner(key))
    await registry.sweeps.keyspace(unified=False, in_flight_ms=0)
    notes = await bus.read_notifications(
        "w2", bus.note_streams("w2", ["web"]), count=10, block_ms=1
    )
    assert notes, order  # the sweep (or the original notification) names the session
    result = await bus.acquire(key, "w2", member=key, note=notes[0])
    assert isinstance(result, Acquired), (order, result)
    assert isinstance(result.step, Entry), (order, result.step)


async def test_a_dead_workers_leftovers_are_pruned(redis: aioredis.Redis) -> None:
    bus = RedisBus(redis, lock_ttl_ms=300)
    registry = Registry(bus)
    streams = bus.note_streams("dead", ["web"])
    await bus.ensure_groups(streams)
    await bus.read_notifications("dead", streams, count=1, block_ms=1)  # creates its consumer
    await registry.heartbeat("dead", {"pid": "1"}, ttl_ms=900)
    await redis.xadd(bus.keys.inbox("dead"), {"session": "web:x"})
    await redis.zadd(bus.keys.workers, {"dead": 1})  # last seen long ago
    assert await registry.prune_dead_workers(older_than_ms=0, streams=streams) == ["dead"]
    assert not await redis.exists(bus.keys.inbox("dead"), bus.keys.worker_info("dead"))
    assert await redis.zcard(bus.keys.workers) == 0
    assert await redis.xinfo_consumers(bus.keys.ready("web"), "workers") == []


@pytest.mark.parametrize("skew_s", [-600, 600], ids=["slow", "fast"])
async def test_hosts_whose_clocks_differ_judge_workers_alike(
    real_redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch, skew_s: int
) -> None:
    """Heartbeats are stamped with Redis's clock: a worker on a host whose clock runs ten
    minutes ahead used to prune every live worker (their records, their inboxes) as dead,
    and one whose clock lags was pruned by the others while alive. (Real Redis only:
    fakeredis reads the test process's clock, the one skewed here.)"""
    redis = real_redis
    bus = RedisBus(redis, lock_ttl_ms=300)
    registry = Registry(bus)
    streams = bus.note_streams("right", ["web"])
    await bus.ensure_groups(streams)
    await registry.heartbeat("right", {"pid": "1"}, ttl_ms=60_000)
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + skew_s)  # the other host
    await registry.heartbeat("skewed", {"pid": "2"}, ttl_ms=60_000)
    assert await registry.prune_dead_workers(older_than_ms=60_000, streams=streams) == []
    monkeypatch.setattr(time, "time", real_time)  # and the right host
    assert await registry.prune_dead_workers(older_than_ms=60_000, streams=streams) == []
    assert await redis.zcard(bus.keys.workers) == 2


async def test_wire_values_are_escaped_in_logs(
    redis_factory, make_loop, caplog: pytest.LogCaptureFixture
) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.INFO)
    make_loop(ScriptedProvider(handler=_echo))
    client = FrontendClient(redis_factory())
    forged = "x\n2026-11-30 00:00:00 ERROR forged line"
    await client.send_raw(f"web:{forged}", "not json")
    ok = await client.send(_m("ok", "fine"))
    await collect(client, "web", {ok})
    assert "x\\n2026-11-30 00:00:00 ERROR forged line" in caplog.text  # logged, escaped
    assert "\n2026-11-30 00:00:00 ERROR" not in caplog.text  # no forged line
    assert not any("\n" in r.getMessage() for r in caplog.records)


def test_an_empty_openai_base_url_means_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.app import make_provider
    from worker.settings import Settings

    monkeypatch.setenv("OPENAI_BASE_URL", "")  # what docker-compose passes when unset
    monkeypatch.setenv("OPENAI_API_KEY", "k")
    provider = make_provider(Settings(provider="openai"))
    assert provider.url == "https://api.openai.com/v1/chat/completions"  # type: ignore[attr-defined]


async def _echo(**kw: Any) -> LLMResponse:
    return LLMResponse(content=f"re: {kw['messages'][-1]['content']}")


async def test_junk_a_frontend_can_write_never_stops_a_worker(redis_factory, make_loop) -> None:  # type: ignore[no-untyped-def]
    """Bytes that are not UTF-8 on the control channel and in the ready queue, an inbound
    stream with a malformed name, keys of the wrong type beside a session, a lone
    surrogate and deep nesting in payloads: every one is dropped or answered, and the
    worker still serves and still stops turns."""
    raw = redis_factory()
    k = Keys()
    started = asyncio.Event()

    async def handler(**kw: Any) -> LLMResponse:
        if "hold" in str(kw["messages"][-1]["content"]):
            started.set()
            await asyncio.Event().wait()
        return LLMResponse(content=f"re: {kw['messages'][-1]['content']}")

    loop = make_loop(ScriptedProvider(handler=handler), sweep_interval_ms=50, lock_ttl_ms=300)
    await until(lambda: loop._streams != [])
    await raw.publish(k.control("web"), b"\xff\xfe")
    await raw.xadd(k.ready("web"), {b"session": b"web:\xff"})
    await raw.xadd("agent:{web}:in:%ZZ", {"payload": "x"})
    await raw.xadd("agent:{web}:in:web:%77x", {"payload": "x"})  # not the canonical name
    await raw.xadd(k.control_hint("web:j"), {"a": "b"})  # a stream where a counter belongs
    await raw.set(k.out("web:j"), "not a stream")
    client = FrontendClient(redis_factory())
    surrogate = '{"v":2,"channel":"web","sender_id":"u","chat_id":"j","content":"half \\ud83d"}'
    nested: Any = 1
    for _ in range(40):
        nested = [nested]
    deep = json.dumps(
        {"v": 2, "channel": "web", "sender_id": "u", "chat_id": "j", "metadata": {"a": nested}}
    )
    first = await client.send_raw("web:j", surrogate)
    second = await client.send_raw("web:j", deep)
    got = await collect(client, "web", {first, second})
    assert got[first][-1].content == "re: half \ufffd"
    assert got[second][-1].code == "invalid_message"
    held = await client.send(_m("j", "hold on"))
    await asyncio.wait_for(started.wait(), 10)
    await client.stop("web:j")  # the control subscription survived the junk
    assert (await collect(client, "web", {held}))[held][-1].code == "cancelled"

    async def swept() -> bool:
        return not await raw.exists("agent:{web}:in:%ZZ", "agent:{web}:in:web:%77x")

    await until(swept)


async def test_private_sessions_are_bounded_per_worker_and_channel(
    redis_factory, make_loop
) -> None:  # type: ignore[no-untyped-def]
    """A frontend cannot fill a worker's memory with private sessions: a cap per channel,
    an idle expiry (the frontend is told), and a bounded history per session."""
    loop = make_loop(
        ScriptedProvider(handler=_echo),
        max_private_sessions=2,
        private_idle_s=1,
        private_history_rows=10,
        lock_ttl_ms=300,
    )
    client = FrontendClient(redis_factory())
    opened = [
        await client.open_transient("web", f"p{i}", session_key=f"web:p{i}") for i in range(3)
    ]
    got = await collect(client, "web", {rid for _, rid in opened})
    codes = {f"p{i}": got[rid][-1].code for i, (_, rid) in enumerate(opened)}
    # the three opens are served concurrently: any one of them may be the one refused
    assert sorted(str(c) for c in codes.values()) == ["None", "None", "limit_exceeded"]
    first, second = (p for p, code in codes.items() if code is None)
    private = {"session_key_override": f"web:{first}", "require_existing_session": True}
    for i in range(8):  # 16 rows, 10 kept
        reply = await client.ask(_m(first, f"m{i}", **private), timeout_s=10)
        assert reply.content == f"re: m{i}"
    session = loop.sessions.get_cached(f"web:{first}")
    assert session is not None
    assert len(session.messages) <= 10
    assert session.messages[0]["role"] == "user"

    async def closed() -> bool:  # idle past private_idle_s: closed, frontend told
        events = await channel_events(client, "web")
        return not loop.turns.owned() and sum(e.code == "session_lost" for e in events) == 2

    await until(closed, timeout_s=15)
    late = await client.ask(_m(second, "still there?", session_key_override=f"web:{second}", require_existing_session=True), timeout_s=10)  # fmt: skip
    assert late.code == "session_not_active"


async def test_hints_without_a_stream_are_swept(redis_factory, make_loop) -> None:  # type: ignore[no-untyped-def]
    raw = redis_factory()
    k = Keys()
    for i in range(5):
        await raw.incrby(k.control_hint(f"web:ghost{i}"), 1)  # no stream beside them
    await FrontendClient(redis_factory()).stop("web:real")  # a hint with its marker queued
    make_loop(ScriptedProvider(handler=_echo), sweep_interval_ms=50, lock_ttl_ms=300)

    async def swept() -> bool:
        left = await raw.exists(*(k.control_hint(f"web:ghost{i}") for i in range(5)))
        return left == 0

    await until(swept)


async def test_start_up_checks_refuse_a_live_twin_and_another_mode(redis: aioredis.Redis) -> None:
    import socket
    import time as _time

    from worker.runtime.registration import WorkerConflictError, check_can_serve

    bus = RedisBus(redis)
    now_ms = int(_time.time() * 1000)
    await redis.zadd(bus.keys.workers, {"w": now_ms})
    await redis.hset(bus.keys.worker_info("w"), mapping={"host": "elsewhere", "pid": "1"})
    with pytest.raises(WorkerConflictError, match="in use by pid 1 on elsewhere"):
        await check_can_serve(bus, "w", unified=False)
    dead = {"host": socket.gethostname(), "pid": "999999999"}  # crashed here: may restart
    await redis.hset(bus.keys.worker_info("w"), mapping=dead)
    await check_can_serve(bus, "w", unified=False)
    with pytest.raises(WorkerConflictError, match="per-session mode and this one in single-owner"):
        await check_can_serve(bus, "w2", unified=False, single_owner=True)


async def test_of_twins_started_at_once_with_one_worker_id_only_one_serves(
    redis: aioredis.Redis,
) -> None:
    """Both look before either has written a heartbeat: the id is claimed atomically, and
    the second to claim it is refused with whose it is (else both would serve, beating
    for each other, and neither's leases would be taken over when one is killed)."""
    from worker.runtime.registration import WorkerConflictError, check_can_serve

    bus = RedisBus(redis)
    looked = redis.zscore

    async def twin_claims_meanwhile(*args: Any) -> Any:  # between our look and our claim
        keys = [bus.keys.worker_info("t"), bus.keys.workers]
        assert await bus.scripts.call("claim", keys, ["t", "", "twin", "h2", 4242, 30000, 1]) == 1
        return await looked(*args)

    redis.zscore = twin_claims_meanwhile  # type: ignore[method-assign]
    with pytest.raises(WorkerConflictError, match="in use by pid 4242 on h2"):
        await check_can_serve(bus, "t", unified=False)


async def test_a_hint_that_is_no_integer_cannot_break_a_discard(redis_factory, make_loop) -> None:  # type: ignore[no-untyped-def]
    """Without an ACL a client can SET the hint to "1.5": the marker is still consumed in
    one piece (the junk hint deleted), the discard applies, the next message runs."""
    raw = redis_factory()
    client = FrontendClient(redis_factory())
    await client.send(_m("d", "first", id="first"))
    await client.discard("web:d")
    await raw.set(Keys().control_hint("web:d"), "1.5")
    after = await client.send(_m("d", "after", id="after"))
    loop = make_loop(ScriptedProvider(handler=_echo))
    got = await collect(client, "web", {"first", after})
    assert got["first"][-1].code == "cancelled"
    assert got[after][-1].content == "re: after"
    assert loop.sessions.get_cached("web:d") is not None  # only the turn after the marker
    stored = await loop.sessions.read_session("web:d")
    assert stored is not None
    assert [m["content"] for m in stored["messages"] if m["role"] == "user"] == ["after"]


@pytest.mark.real_redis  # fakeredis fails inside its connection on XREAD of a string key
async def test_ask_gets_its_answer_over_a_junk_event_key(real_redis: aioredis.Redis) -> None:
    await real_redis.set(Keys().out("web:o"), "not a stream")  # written without an ACL
    loop = AgentLoop(
        RedisBus(real_redis), ScriptedProvider(handler=_echo), config=LoopConfig(read_block_ms=50)
    )
    task = asyncio.create_task(loop.run())
    try:
        answer = await FrontendClient(real_redis).ask(_m("o", "hello"), timeout_s=10)
    finally:
        loop.stop()
        await asyncio.wait_for(task, 10)
    assert answer.content == "re: hello"


async def test_a_failing_maintenance_step_skips_no_other(redis_factory, make_loop) -> None:  # type: ignore[no-untyped-def]
    """The janitor's step meets a key it cannot handle (a WRONGTYPE answer, a bug): the
    steps after it in the tick (schedules, stale claims, lost owners) used to be skipped,
    tick after tick, for every channel."""
    from redis.exceptions import ResponseError

    loop = make_loop(ScriptedProvider(handler=_echo))
    await until(lambda: bool(loop.maintenance.channels))  # started

    async def broken(**_kw: object) -> int:
        raise ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value")

    loop.rt.registry.sweeps.hints = broken
    loop.rt.registry.take_sweep_turn = _yes  # this worker sweeps this period
    ran: list[set[str]] = []

    async def periodic(channels: set[str]) -> None:
        ran.append(channels)

    loop.maintenance.periodic = periodic
    await loop.maintenance.tick()
    assert ran, "the schedules step was skipped"


async def _yes(*_args: object) -> bool:
    return True
