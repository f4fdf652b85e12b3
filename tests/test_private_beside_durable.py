"""A private session opened on a chat key that also holds a durable session (the wire
allows it: ``open_transient`` takes any ``session_key_override`` of the channel, and
``replies.open_private`` opens on the chat's own key), and the bounds of a private
session's memory, as a hostile reviewer attacked them: the durable session's
consolidation, idle prune, delete and schedules reaching the private session beside it; a
private history that grows on turns that got no answer; one channel's spawns making a
stop of another channel's session forget its queued subagent. Each test failed on the
code it was written against, for the reason its docstring gives."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import redis.asyncio as aioredis
from helpers import ScriptedProvider, Spawner, answering, held_jobs
from replies import channel_events, collect, open_private, until

import worker.jobs.subagent_aborts as subagents_module
from bus_redis import FrontendClient, InboundMessage, Keys, RedisBus
from session_store.codec import decode_meta
from worker import AgentLoop
from worker.agent.providers import LLMResponse, ProviderError, ToolCallRequest
from worker.jobs.subagents import JOB_NAME as SUBAGENT_JOB

K = Keys()
SUMMARY = '{"memory": "the user likes tea", "history": "talked about tea"}'


def _durable(chat: str, text: str, id_: str, **kw: Any) -> InboundMessage:
    """A message of the durable session ``web:<chat>``."""
    return InboundMessage(channel="web", sender_id="u", chat_id=chat, content=text, id=id_, **kw)


def _private(key: str, text: str, id_: str, **kw: Any) -> InboundMessage:
    """A message of the private session ``key`` (``web:<chat>``), as the contract says."""
    chat = key.split(":", 1)[1]
    return InboundMessage(
        channel="web", sender_id="u", chat_id=chat, content=text, id=id_,
        session_key_override=key, require_existing_session=True, **kw,
    )  # fmt: skip


def _summarising() -> ScriptedProvider:
    """A model that summarises when asked to consolidate and answers "ok" otherwise."""

    async def answer(**call: Any) -> LLMResponse:
        if str(call["messages"][0]["content"]).startswith("Summarise"):
            return LLMResponse(content=SUMMARY)
        return LLMResponse(content="ok")

    return ScriptedProvider(handler=answer)


async def _durable_then_private(client: FrontendClient, chat: str) -> str:
    """Two answered durable turns in ``web:<chat>`` (four stored rows), then a private
    session opened on the same key with one answered turn ("PRIVATE-ONE"); its key."""
    for i in range(2):
        reply = await client.ask(_durable(chat, f"durable turn {i}", f"d{i}"), timeout_s=10)
        assert reply.type == "message"
    key = await open_private(client, chat)
    assert key == f"web:{chat}"
    reply = await client.ask(_private(key, "PRIVATE-ONE is my code word", "p1"), timeout_s=10)
    assert (reply.type, reply.code) == ("message", None)
    return key


async def _next_private_turn_sees_the_first(
    client: FrontendClient, provider: ScriptedProvider, key: str
) -> None:
    """The private session goes on: its next message is answered, on its own history."""
    reply = await client.ask(_private(key, "what was my code word?", "p2"), timeout_s=10)
    assert (reply.type, reply.code) == ("message", None), (
        f"the live private session was dropped: its next message got {reply.code}"
    )
    assert "PRIVATE-ONE" in json.dumps(provider.calls[-1]["messages"]), (
        "the private session's next turn ran without its earlier rows"
    )


# --- 1. consolidation of the durable session --------------------------------------------


def scheduling(calls: list[str], ask: str, message: str) -> ScriptedProvider:
    """A model that adds an hourly schedule saying ``message`` when asked ``ask`` and
    answers "ok" otherwise; every prompt it gets goes to ``calls``."""

    async def model(**kw: Any) -> LLMResponse:
        calls.append(json.dumps(kw["messages"]))
        last = kw["messages"][-1]
        if last["role"] == "user" and last["content"] == ask:
            args = {"action": "add", "every_seconds": 3600, "message": message}
            return LLMResponse(tool_calls=[ToolCallRequest("c1", "cron", args)])
        return LLMResponse(content="ok")

    return ScriptedProvider(handler=model)


async def test_consolidating_the_durable_session_keeps_the_private_session_on_its_key(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """``Consolidator._commit`` ends with ``SessionManager.invalidate(key)`` to reload the
    durable copy; ``invalidate`` also pops the key's pinned private session. A
    consolidation job of the durable chat (queued by its turns, run on the worker that
    owns the private session opened on the chat's key since) therefore silently ends the
    live private session: its next message gets ``session_not_active``, no
    ``session_lost`` was ever told."""
    provider = _summarising()
    loop = make_loop(provider)
    client = FrontendClient(redis)
    key = await _durable_then_private(client, "c")
    await loop.consolidator.run_job(key=key, start=0, end=2)  # the durable session's job
    meta = decode_meta(await redis.hget(K.session(key), "meta"))
    assert int(meta.get("last_consolidated", 0)) == 2  # it ran and committed
    await _next_private_turn_sees_the_first(client, provider, key)


# --- 2. the idle prune of the durable session -------------------------------------------


async def _prune_the_durable_session(redis: aioredis.Redis, loop: AgentLoop, key: str) -> None:
    """Make the durable session of ``key`` look idle past the retention and run the idle
    prune (as the sweep does)."""
    assert await redis.zadd(K.sessions_index("web"), {key: 1}, xx=True, ch=True) == 1
    await loop.maintenance.prune_idle()


async def test_the_idle_prune_of_the_durable_session_keeps_the_private_session_on_its_key(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """``Maintenance.prune_idle`` calls ``SessionManager.invalidate`` for every key
    ``prune_idle`` deleted, which also drops the pinned private session of that key: a
    durable chat idle for ``AGENT_SESSION_TTL_S`` ends a live private session opened on
    its key (nothing tells the frontend; its next message gets ``session_not_active``)."""
    provider = _summarising()
    loop = make_loop(provider)
    client = FrontendClient(redis)
    key = await _durable_then_private(client, "i")
    await _prune_the_durable_session(redis, loop, key)
    await _next_private_turn_sees_the_first(client, provider, key)


async def test_the_idle_prune_of_the_durable_session_keeps_the_private_sessions_events(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """``RedisSessionStore.prune_idle`` takes the key's lease (free between private
    turns), finds no queued entry and runs ``delete.lua``, which deletes ``out:S``
    whole: the answer of a private turn not read yet by its frontend (kept
    ``AGENT_TRANSIENT_REPLY_TTL_MS``) is gone, although the prune is of the idle durable
    session only."""
    loop = make_loop(answering("PRIVATE-ANSWER"))
    client = FrontendClient(redis)
    for i in range(2):
        reply = await client.ask(_durable("e", f"durable {i}", f"d{i}"), timeout_s=10)
        assert reply.type == "message"
    key = await open_private(client, "e")
    await client.send(_private(key, "hello", "p1"))  # its answer not read yet (no ask)
    await collect(client, "web", {"p1"}, timeout_s=10)  # ... but written
    await _prune_the_durable_session(redis, loop, key)
    left = [
        e.content
        for e in await channel_events(client, "web")
        if e.reply_to == "p1" and e.is_terminal
    ]
    assert left == ["PRIVATE-ANSWER"], "the idle prune deleted the private session's events"


# --- 3. delete with a private session open on the key -----------------------------------


async def test_a_delete_with_a_private_session_open_deletes_the_durable_history(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """README: ``delete`` "is a discard that also deletes a durable session's stored
    history, its index entries and its events". ``SessionHolder.discarded`` runs
    ``delete_held`` only ``if op in ("delete", "new") and owned is None``: with a private
    session open on the key (owned here) the delete only discards it, and the durable
    conversation stays stored (its text readable by ``read_session`` / the gateway's
    ``/messages``) after the user deleted the chat."""
    loop = make_loop(answering())
    client = FrontendClient(redis)
    reply = await client.ask(_durable("d", "DURABLE-SECRET-4242", "d0"), timeout_s=10)
    assert reply.type == "message"
    key = await open_private(client, "d")
    assert (await client.ask(_private(key, "hi", "p1"), timeout_s=10)).type == "message"
    await client.delete(key)

    async def carried_out() -> bool:  # the marker is consumed after its effect
        return key not in loop.turns.owned() and not await redis.xlen(K.inbound(key))

    await until(carried_out, timeout_s=10)
    stored = await redis.hgetall(K.session(key))
    assert not stored, "the durable session's history survived its delete"
    assert await redis.zscore(K.sessions_index("web"), key) is None


# --- 4. a private history's bound on turns without an answer ----------------------------

BOUND = 10  # AGENT_PRIVATE_HISTORY_ROWS' least value
TURNS = 16  # each leaves its user row: more rows than the bound


def _rows_kept(loop: AgentLoop, key: str) -> int:
    session = loop.sessions.get_cached(key)
    assert session is not None
    assert loop.sessions.is_transient(key)
    return len(session.messages)


async def test_provider_errors_keep_a_private_history_within_its_bound(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """README: a worker keeps "the newest ``AGENT_PRIVATE_HISTORY_ROWS`` (400) rows" of a
    private session (its memory, which a frontend must not be able to fill).
    ``trim_transient`` runs only in ``TurnExecution._answered``: a turn ending in
    ``provider_error`` appends its user row (``legal_prefix``) and never trims, so a
    model that is down (or a frontend whose messages make it fail) grows the history
    without bound."""

    async def down(**kw: Any) -> LLMResponse:
        raise ProviderError("the model is down")

    loop = make_loop(ScriptedProvider(handler=down), private_history_rows=BOUND)
    client = FrontendClient(redis)
    key = await open_private(client, "pe")
    for i in range(TURNS):
        reply = await client.ask(_private(key, f"message {i}", f"m{i}"), timeout_s=10)
        assert reply.code == "provider_error"
    kept = _rows_kept(loop, key)
    assert kept <= BOUND, f"{kept} rows kept in memory, over the bound of {BOUND}"


async def test_stopped_turns_keep_a_private_history_within_its_bound(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """The same for stops: a stopped turn keeps its work up to its last complete tool
    exchange (its user row at least) and is never trimmed either."""
    entered: list[int] = []
    never = asyncio.Event()

    async def slow(**kw: Any) -> LLMResponse:
        entered.append(1)
        await never.wait()  # until the stop cancels it
        return LLMResponse(content="never")

    loop = make_loop(ScriptedProvider(handler=slow), private_history_rows=BOUND)
    client = FrontendClient(redis)
    key = await open_private(client, "st")
    for i in range(TURNS):
        await client.send(_private(key, f"message {i}", f"m{i}"))
        await until(lambda n=i + 1: len(entered) == n, timeout_s=10)  # its model call runs
        await client.stop(key)
        got = await collect(client, "web", {f"m{i}"}, timeout_s=10)
        assert [e.code for e in got[f"m{i}"] if e.is_terminal] == ["cancelled"]
    kept = _rows_kept(loop, key)
    assert kept <= BOUND, f"{kept} rows kept in memory, over the bound of {BOUND}"


# --- 5. spawned_here: one LRU for every channel -----------------------------------------


async def test_a_stop_unregisters_a_queued_subagent_after_another_channels_spawns(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README: a stop "published after the message that spawned a subagent aborts it: ...
    one not started yet never starts"; the module doc: "the worker that spawned them also
    unregisters those not started yet" (a worker started after the control does not know
    it: "the spawner's unregistration still holds"). That unregistration happens only
    ``if session in self.spawned_here``, an LRU of ``SPAWNED_HERE_MAX`` sessions shared by
    every channel (the stop table beside it is per channel for this very reason): another
    channel's spawns evict the session, the stop then unregisters nothing, and the queued
    subagent runs on the next worker that takes its job and its result comes back.
    (The bound is made small here, as the real 10,000 would be by a busy channel.)"""
    monkeypatch.setattr(subagents_module, "SPAWNED_HERE_MAX", 4)
    spawner = Spawner()
    loop = make_loop(ScriptedProvider(handler=spawner), followup_mode="queue")
    queued = held_jobs(loop, SUBAGENT_JOB)  # the subagent jobs, held in the queue (a backlog)
    client = FrontendClient(redis)
    reply = await client.ask(_durable("s", "research the answer", "q"), timeout_s=10)
    assert reply.type == "message"
    [ours] = queued
    for i in range(4):  # another channel's users spawn too
        other = InboundMessage(
            channel="cli", sender_id=f"u{i}", chat_id=f"o{i}", content="research more", id=f"o{i}"
        )
        assert (await client.ask(other, timeout_s=10)).type == "message"
    assert len(queued) == 5  # every spawn queued, none started
    assert spawner.subagent_runs == 0
    await client.stop("web:s")
    await until(lambda: "web:s" in loop.subagents.aborts.stopped.get("web", {}), timeout_s=10)
    await asyncio.gather(*list(loop.rt.background))  # the unregistration it started, if any

    late = AgentLoop(RedisBus(redis), ScriptedProvider(handler=spawner))  # after the stop
    try:
        await late.subagents.run_job(session=ours["session"], sid=ours["sid"])
    finally:
        await late.jobs.aclose()
    assert spawner.subagent_runs == 0, "the stopped session's queued subagent ran"
    assert not await redis.exists(K.spawned("web:s")), "it is still registered"


# --- 7. a durable schedule firing while a private session holds the key -----------------


@pytest.mark.parametrize("single_owner", [False, True])  # (a second reading: both modes)
async def test_a_durable_schedule_never_fires_into_the_private_session_on_its_key(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop, single_owner: bool
) -> None:
    """README: a worker-made message "never starts a session" and does not run when its
    ``from`` is older than the entry that started the session now stored ("a firing ...
    never runs in the next one, maybe another user's"). ``scopes.check_scope`` judges that by
    ``session.born``; ``_open_transient`` sets a private session's scope (from the
    opening's vouched ``scope``, as the gateway sends) but never its ``born``, so a
    firing of the durable chat's schedule runs in the private conversation opened on its
    key: the model gets the private history with the firing, and the firing's exchange
    lands in the private session."""
    calls: list[str] = []
    model = scheduling(calls, "remind me", "STRETCH-NOW")
    loop = make_loop(model, followup_mode="queue", single_owner=single_owner)
    client = FrontendClient(redis)
    reply = await client.ask(_durable("cr", "remind me", "r1", scope="u"), timeout_s=10)
    assert reply.type == "message"
    [sid] = list(await redis.smembers(K.crons("web:cr")))
    key, opened = await client.open_transient("web", "cr", session_key="web:cr", scope="u")
    await collect(client, "web", {opened}, timeout_s=10)
    private = _private(key, "PRIVATE-SECRET-77", "p1", scope="u")
    assert (await client.ask(private, timeout_s=10)).type == "message"

    seconds, micros = await redis.time()
    due = int(seconds) * 1000 + int(micros) // 1000 - 1000  # the firing is due now
    assert await redis.zadd(K.cron_due("web"), {sid: due}, xx=True, ch=True) == 1
    # (a later stop) put off while the private session is open, not delivered and lost
    assert not await loop.schedules.fire(channel="web", sid=sid, due_ms=due)
    later = int(await redis.zscore(K.cron_due("web"), sid))
    assert later > due, "a firing put off must move in the due index"
    stream = await redis.xrange(K.inbound(key))
    assert not [e for e in stream if b"STRETCH-NOW" in e[1].get(b"payload", b"")]

    into_private = [c for c in calls if "STRETCH-NOW" in c and "PRIVATE-SECRET-77" in c]
    assert not into_private, "the durable chat's schedule fired into the private conversation"
    rows = json.dumps(loop.sessions.get_cached(key).messages)  # type: ignore[union-attr]
    assert "STRETCH-NOW" not in rows, "the firing's exchange is in the private history"


async def test_a_private_sessions_provider_error_is_logged_without_its_key(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop, caplog: pytest.LogCaptureFixture
) -> None:
    """README: a private session's log line carries sizes only. Its provider error was
    logged as "provider error in <its key>" (a reviewer's reading): the key names the
    chat (a user's, for a gateway), which a private session's lines never do."""

    async def down(**kw: Any) -> LLMResponse:
        raise ProviderError("the model is down")

    make_loop(ScriptedProvider(handler=down))
    client = FrontendClient(redis)
    key = await open_private(client, "alice-diary-7")
    caplog.set_level("INFO")
    reply = await client.ask(_private(key, "hello", "m1"), timeout_s=10)
    assert reply.code == "provider_error"
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "provider error in a private session" in logged
    assert "alice-diary-7" not in logged


# --- 8. (a later stop) the durable session's consolidation job on another worker --------


async def test_a_consolidation_job_elsewhere_leaves_the_key_of_a_private_session_alone(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, redis_factory, make_loop
) -> None:
    """A worker other than the private session's owner runs the stored session's
    consolidation job. Its commit cannot take the key's lease (the acquire is forwarded
    to the owner), so the summary it asked the model for was thrown away: a model call
    (tokens, money) for nothing, each time the job ran. Now the job looks at the key's
    owner record first and leaves, with no model call; the stored session's next commit
    queues it again."""
    owner_provider = _summarising()
    owner = make_loop(owner_provider)
    client = FrontendClient(redis)
    key = await _durable_then_private(client, "cj")
    assert owner.turns.owns(key)
    other_provider = _summarising()
    other = AgentLoop(RedisBus(redis_factory()), other_provider)
    await other.consolidator.run_job(key=key, start=0, end=2)
    summaries = [c for c in other_provider.calls if "Summarise" in json.dumps(c["messages"])]
    assert not summaries, "the job asked the model for a summary it could not commit"
    meta = decode_meta(await redis.hget(K.session(key), "meta"))
    assert int(meta.get("last_consolidated", 0)) == 0
    await _next_private_turn_sees_the_first(client, owner_provider, key)
    await other.jobs.aclose()
