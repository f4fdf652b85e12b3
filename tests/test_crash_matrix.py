"""A crash matrix: kill -9 of real worker processes at every fault point (and at points
no fault point names, through a ``sitecustomize`` that wraps one method of the worker to
``os._exit(137)`` around its call) in the paths the existing crash tests leave out:
unified mode, private sessions, a ``new``'s fold, consolidation, firings, subagents.
Each test checks what the README promises after a crash: every inbound message one
terminal event, a non-idempotent tool's effect once, no key left behind, the session
answered by the survivor."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import redis.asyncio as aioredis
from replies import channel_events, collect, no_leftovers, until
from servers import RedisServer
from workers import crash_env

from bus_redis import FrontendClient, InboundMessage, Keys

pytestmark = [pytest.mark.real_redis, pytest.mark.slow]
FAST = {"AGENT_LOCK_TTL_MS": "1000", "AGENT_OWNER_TTL_MS": "1500", "AGENT_SWEEP_INTERVAL_MS": "500"}
UNIFIED = {**FAST, "AGENT_UNIFIED_SESSION": "1"}


def _m(chat: str, mid: str, text: str, **kw: Any) -> InboundMessage:
    return InboundMessage(id=mid, channel="web", sender_id="u", chat_id=chat, content=text, **kw)


def _tool_text(tag: str) -> str:
    return f'[{tag}] toolcall:message{{"content": "effect {tag}"}} now'


async def _progress(redis: aioredis.Redis, key: str, content: str) -> int:
    rows = await redis.xrange(Keys().out(key))
    docs = [json.loads(fields["payload"]) for _, fields in rows]
    return sum(d.get("type") == "progress" and d.get("content") == content for d in docs)


def _terminals(got: dict[str, list[Any]], mid: str) -> list[Any]:
    return [ev for ev in got.get(mid, []) if ev.is_terminal]


async def _died(proc: Any) -> int:
    return await asyncio.to_thread(proc.proc.wait, 30)


# --- unified mode: the fault points under the shared lease -----------------------------


@pytest.mark.parametrize("point", ["tool_recorded", "tool_ran"])
async def test_unified_kill_between_a_tool_and_the_commit_runs_the_effect_once(
    real_redis, spawn_workers, point: str
) -> None:  # type: ignore[no-untyped-def]
    [doomed] = spawn_workers(1, env={**UNIFIED, "AGENT_FAULT_POINTS": point})
    client = FrontendClient(real_redis)
    await client.send(_m("u1", "m1", _tool_text(point)))
    assert await _died(doomed) == 137
    spawn_workers(1, env=UNIFIED)
    later = await client.send(_m("u2", "m2", "after the crash"))
    got = await collect(client, "web", {"m1", later}, timeout_s=30)

    assert [ev.type for ev in _terminals(got, "m1")] == ["message"]
    assert [ev.type for ev in _terminals(got, later)] == ["message"]
    assert await _progress(real_redis, "web:u1", f"effect {point}") == 1
    if point == "tool_ran":
        assert _terminals(got, "m1")[0].metadata.get("resumed") == {"unknown_effects": ["message"]}
    journal = Keys().journal("unified:default")
    await until(lambda: _gone(real_redis, journal), timeout_s=10)


@pytest.mark.parametrize("point", ["after_read", "after_acquire", "before_commit", "after_commit"])
async def test_unified_kill_at_each_step_answers_each_chat_once(
    real_redis, spawn_workers, point: str
) -> None:  # type: ignore[no-untyped-def]
    [doomed] = spawn_workers(1, env={**UNIFIED, "AGENT_FAULT_POINTS": point})
    client = FrontendClient(real_redis)
    first = await client.send(_m("a", "a1", "first of a"))
    assert await _died(doomed) == 137
    spawn_workers(1, env=UNIFIED)
    rest = {await client.send(_m(c, f"{c}2", f"then {c}")) for c in ("a", "b")}
    got = await collect(client, "web", {first} | rest, timeout_s=30)

    for mid in {first} | rest:
        assert len(_terminals(got, mid)) == 1, mid
    h = await real_redis.hgetall(Keys().session("unified:default"))
    users = [
        json.loads(h[f"m:{i}"])["content"]
        for i in range(int(h["count"]))
        if json.loads(h[f"m:{i}"])["role"] == "user"
    ]
    assert sorted(users) == ["first of a", "then a", "then b"]
    await no_leftovers(real_redis, ["unified:default", "web:a", "web:b"])


# --- private sessions: an opening, a turn, a discard cut by a crash --------------------


@pytest.mark.parametrize("point", ["after_acquire", "before_commit", "after_commit"])
async def test_a_private_opening_cut_by_a_crash_gets_one_answer_and_leaves_no_owner(
    real_redis, spawn_workers, point: str
) -> None:  # type: ignore[no-untyped-def]
    [doomed] = spawn_workers(1, env={**FAST, "AGENT_FAULT_POINTS": point})
    client = FrontendClient(real_redis)
    key, opened = await client.open_transient("web", "p", session_key="web:p-private")
    assert await _died(doomed) == 137
    spawn_workers(1, env=FAST)
    got = await collect(client, "web", {opened}, timeout_s=30)
    assert len(_terminals(got, opened)) == 1
    ask = await client.send(
        _m("p", "p1", "still there?", session_key_override=key, require_existing_session=True)
    )
    got = await collect(client, "web", {ask}, timeout_s=30)
    [answer] = _terminals(got, ask)
    if point == "after_commit":  # the session was the dead worker's
        assert answer.code == "session_not_active"
    await client.discard(key)
    await until(lambda: _gone(real_redis, Keys().owner(key)), timeout_s=15)
    await no_leftovers(real_redis, [key])
    # (the channel's index of owners is tidied by the owner's renewal or the sweep, a
    # tick after the record: it must empty, not at once)
    await until(lambda: _zero(real_redis, Keys().owners("web")), timeout_s=15)


async def test_a_private_turn_whose_worker_is_killed_mid_call_gets_one_terminal_event(
    real_redis, spawn_workers, fake_llm
) -> None:  # type: ignore[no-untyped-def]
    [owner] = spawn_workers(1, env=FAST)
    client = FrontendClient(real_redis)
    key, opened = await client.open_transient("web", "q", session_key="web:q-private")
    await collect(client, "web", {opened}, timeout_s=20)
    spawn_workers(1, env=FAST)
    mid = await client.send(
        _m("q", "q1", "block private", session_key_override=key, require_existing_session=True)
    )
    assert await asyncio.to_thread(fake_llm.started.wait, 20)
    owner.kill()
    fake_llm.release()
    got = await collect(client, "web", {mid}, timeout_s=30)

    assert [ev.code for ev in _terminals(got, mid)] in (["session_lost"], ["session_not_active"])
    await until(lambda: _gone(real_redis, Keys().owner(key)), timeout_s=15)
    await until(lambda: _zero(real_redis, Keys().owners("web")), timeout_s=15)
    assert not await real_redis.exists(Keys().session(key))
    assert not await real_redis.xrange(Keys().inbound(key))


# --- a `new` or `delete` marker cut by a crash (no fault point there) -------------------


@pytest.mark.parametrize(
    ("target", "when"),
    [
        ("bus_redis.streams:RedisBus.consolidate", "before"),  # the fold's commit
        ("bus_redis.streams:RedisBus.consolidate", "after"),
        ("session_store.redis_store:RedisSessionStore.delete_held", "after"),
    ],
)
async def test_a_new_cut_by_a_crash_folds_once_and_clears_the_session(
    real_redis, spawn_workers, tmp_path, target: str, when: str
) -> None:  # type: ignore[no-untyped-def]
    [doomed] = spawn_workers(1, env={**FAST, **crash_env(tmp_path, target, when)})
    client = FrontendClient(real_redis)
    first = await client.send(_m("n", "n1", "my cat is called Tom"))
    await collect(client, "web", {first}, timeout_s=20)
    await client.new("web:n")
    assert await _died(doomed) == 137
    spawn_workers(1, env=FAST)
    later = await client.send(_m("n", "n2", "fresh start"))
    got = await collect(client, "web", {later}, timeout_s=30)

    assert [ev.type for ev in _terminals(got, later)] == ["message"]
    h = await real_redis.hgetall(Keys().session("web:n"))
    assert h["count"] == "2"  # the new conversation only
    memory = (await real_redis.hgetall(Keys().memory("web/sender:u"))).get("content", "")
    assert memory.count("user: my cat is called Tom") == 1  # folded once
    assert await real_redis.xlen(Keys().memory_history("web/sender:u")) == 1
    await no_leftovers(real_redis, ["web:n"])


# --- a consolidation job cut by a crash -------------------------------------------------


def _folds_of(fake_llm: Any, text: str) -> int:
    """How many summary requests folded a transcript starting at the row ``text``."""
    return sum(
        str(r["messages"][0].get("content", "")).startswith("Summarise")
        and (str(r["messages"][-1].get("content", "")) + "\n").endswith(
            f"# Conversation\nuser: {text}\n"
        )
        for r in fake_llm.requests
    )


@pytest.mark.parametrize("when", ["before", "after"])
async def test_a_consolidation_cut_by_a_crash_folds_once_and_frees_the_session(
    real_redis, spawn_workers, fake_llm, tmp_path, when: str
) -> None:  # type: ignore[no-untyped-def]
    small = {**FAST, "AGENT_CONSOLIDATE_ABOVE_TOKENS": "1"}
    crash = crash_env(tmp_path, "bus_redis.streams:RedisBus.consolidate", when)
    [doomed] = spawn_workers(1, env={**small, **crash})
    client = FrontendClient(real_redis)
    for n in range(5):  # 10 rows: the fifth commit queues a fold of the first two
        mid = await client.send(_m("cs", f"c{n}", f"row c{n}"))
        await collect(client, "web", {mid}, timeout_s=20)
    assert await _died(doomed) == 137
    spawn_workers(1, env=small)
    later = await client.send(_m("cs", "c5", "row c5"))
    got = await collect(client, "web", {later}, timeout_s=20)

    assert [ev.type for ev in _terminals(got, later)] == ["message"]

    async def folded() -> bool:
        h = await real_redis.hgetall(Keys().session("web:cs"))
        return json.loads(h["meta"]).get("last_consolidated", 0) >= 2

    await until(folded, timeout_s=20)
    assert _folds_of(fake_llm, "row c0") == (2 if when == "before" else 1)


# --- a spawn cut by a crash -----------------------------------------------------------


@pytest.mark.parametrize("point", ["tool_ran", "tool_recorded"])
async def test_a_spawn_cut_by_a_crash_runs_its_subagent_once_and_reports_once(
    real_redis, spawn_workers, fake_llm, point: str
) -> None:  # type: ignore[no-untyped-def]
    [doomed] = spawn_workers(1, env={**FAST, "AGENT_FAULT_POINTS": point})
    client = FrontendClient(real_redis)
    args = '{"task": "look it up", "label": "sub"}'
    await client.send(_m("sc", "sc1", f"toolcall:spawn{args}"))
    assert await _died(doomed) == 137
    spawn_workers(1, env=FAST)
    got = await collect(client, "web", {"sc1"}, timeout_s=30)
    assert len(_terminals(got, "sc1")) == 1

    async def reported() -> list[Any]:
        return [
            e
            for e in await channel_events(client, "web")
            if (e.reply_to or "").startswith("spawn:") and e.is_terminal
        ]

    await until(reported, timeout_s=30)
    await until(lambda: _gone(real_redis, Keys().spawned("web:sc")), timeout_s=15)
    runs = [
        r
        for r in fake_llm.requests
        if str(r["messages"][0].get("content", "")).startswith("You are a subagent")
    ]
    assert len(runs) == 1
    assert len(await reported()) == 1
    assert await real_redis.zscore(Keys().subagents("web"), "web:sc") is None


# --- a Redis restart (AOF kept) while turns run ----------------------------------------


@pytest.mark.parametrize("lease_ms", ["1000", "10000"])
async def test_a_redis_restart_with_aof_under_a_running_turn_answers_it_once(
    spawn_workers, fake_llm, lease_ms: str
) -> None:  # type: ignore[no-untyped-def]
    server = RedisServer(aof=True).start()
    redis = None
    try:
        env = {"AGENT_LOCK_TTL_MS": lease_ms, "AGENT_CHANNELS": "web"}
        spawn_workers(2, env=env, url=server.url)
        redis = aioredis.from_url(server.url, decode_responses=True)
        client = FrontendClient(redis)
        mid = await client.send(_m("r", "r1", "block across a restart"))
        assert await asyncio.to_thread(fake_llm.started.wait, 20)
        await redis.aclose()
        server.stop()
        server.start()  # same port, same AOF
        fake_llm.release()
        redis = aioredis.from_url(server.url, decode_responses=True)
        client = FrontendClient(redis)
        later = await client.send(_m("r", "r2", "after the restart"))
        got = await collect(client, "web", {mid, later}, timeout_s=40)

        assert [ev.type for ev in _terminals(got, mid)] == ["message"]
        assert [ev.type for ev in _terminals(got, later)] == ["message"]
        h = await redis.hgetall(Keys().session("web:r"))
        assert h["count"] == "4"
        await no_leftovers(redis, ["web:r"])
    finally:
        if redis is not None:
            await redis.aclose()
        server.cleanup()


async def test_a_private_session_survives_a_quick_redis_restart_with_aof(
    spawn_workers, fake_llm
) -> None:  # type: ignore[no-untyped-def]
    """Nothing was lost (AOF, fsync always, a restart well within the owner TTL): the
    private session's owner is alive and its record is back, so the conversation goes on."""
    server = RedisServer(aof=True).start()
    redis = None
    try:
        spawn_workers(1, env={"AGENT_CHANNELS": "web"}, url=server.url)
        redis = aioredis.from_url(server.url, decode_responses=True)
        client = FrontendClient(redis)
        key, opened = await client.open_transient("web", "s", session_key="web:s-private")
        await collect(client, "web", {opened}, timeout_s=20)
        first = await client.send(
            _m("s", "s1", "remember 42", session_key_override=key, require_existing_session=True)
        )
        await collect(client, "web", {first}, timeout_s=20)
        await redis.aclose()
        server.stop()
        server.start()
        redis = aioredis.from_url(server.url, decode_responses=True)
        client = FrontendClient(redis)
        ask = await client.send(
            _m("s", "s2", "still there?", session_key_override=key, require_existing_session=True)
        )
        got = await collect(client, "web", {ask}, timeout_s=30)

        [answer] = _terminals(got, ask)
        assert (answer.type, answer.code) == ("message", None)
        assert not [ev for ev in await channel_events(client, "web") if ev.code == "session_lost"]
    finally:
        if redis is not None:
            await redis.aclose()
        server.cleanup()


async def test_a_message_that_kills_every_worker_is_dead_lettered(
    real_redis, spawn_workers, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """A payload whose turn kills its worker at every attempt (here: at its model call)
    is dead-lettered after AGENT_MAX_DELIVERIES, not run until no worker is left."""
    target = "worker.agent.providers.openai_provider:OpenAIProvider.chat_with_retry"
    env = {**FAST, "AGENT_MAX_DELIVERIES": "2", **crash_env(tmp_path, target, "before", "pill")}
    client = FrontendClient(real_redis)
    mid = await client.send(_m("poison", "x1", "a poison pill"))
    for _ in range(2):
        [doomed] = spawn_workers(1, env=env)
        assert await _died(doomed) == 137
    [last] = spawn_workers(1, env=env)  # would die too, were the entry run again
    got = await collect(client, "web", {mid}, timeout_s=30)
    assert [ev.code for ev in _terminals(got, mid)] == ["dead_lettered"]
    assert last.proc.poll() is None
    later = await client.send(_m("poison", "x2", "a healthy message"))
    got = await collect(client, "web", {later}, timeout_s=30)
    assert [ev.type for ev in _terminals(got, later)] == ["message"]


# --- helpers ----------------------------------------------------------------------------


async def _gone(redis: aioredis.Redis, key: str) -> bool:
    return await redis.exists(key) == 0


async def _zero(redis: aioredis.Redis, key: str) -> bool:
    return await redis.zcard(key) == 0
