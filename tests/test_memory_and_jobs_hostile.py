"""Hostile review of long-term memory and consolidation, subagents, schedules and the
session tools. Each test states a defect found on review (each failed on the code it was
written against) and the behaviour now expected; the two added with their fixes say so."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis
from helpers import Gate, ScriptedProvider, Spawner
from redis.exceptions import ConnectionError as RedisConnectionError
from replies import collect, spawn_replies, until

from bus_redis import FrontendClient, InboundMessage, Keys, RedisBus
from session_store import Session
from session_store.codec import decode_meta
from worker import AgentLoop, LoopConfig
from worker.agent.providers import LLMResponse, ProviderError, ToolCallRequest
from worker.agent.tools import ToolContext
from worker.agent.tools.sessions import ReadSessionTool
from worker.jobs.schedule_rules import ScheduleError, parse_schedule

K = Keys()
SCOPE = "web/sender:u"


def _msg(chat: str, text: str, id_: str) -> InboundMessage:
    return InboundMessage(id=id_, channel="web", chat_id=chat, sender_id="u", content=text)


async def _rows(redis: aioredis.Redis, key: str) -> list[dict[str, Any]]:
    stored = await redis.hgetall(K.session(key))
    return [
        json.loads(v)
        for _, v in sorted((int(f[2:]), v) for f, v in stored.items() if f.startswith("m:"))
    ]


async def _last_consolidated(redis: aioredis.Redis, key: str) -> int:
    meta = decode_meta(await redis.hget(K.session(key), "meta"))
    return int(meta.get("last_consolidated", 0))


# --- schedules --------------------------------------------------------------------------


class CronAdder:
    """The model as the user steers it: adds the schedule the user dictates."""

    def __init__(self, args: dict[str, Any]) -> None:
        self.args = args

    async def __call__(self, **kw: Any) -> LLMResponse:
        last = kw["messages"][-1]
        if last["role"] == "user" and last["content"] == "schedule it":
            call = ToolCallRequest("c1", "cron", {"action": "add", **self.args})
            return LLMResponse(tool_calls=[call])
        return LLMResponse(content="ok")


async def test_a_cron_expression_cannot_fire_more_often_than_the_minimum_repeat(
    redis, make_loop
) -> None:  # type: ignore[no-untyped-def]
    """Defect: ``AGENT_CRON_MIN_EVERY_S`` (60 s by default) bounds ``every_seconds`` only.
    ``cron_expr`` is passed to cronsim, which also reads a six-field expression with a
    seconds field, so a user can make the model add ``* * * * * *``: a system turn (a model
    call) every second, forever (a session with schedules is never pruned), ten per
    session, in every chat of theirs. Expected: a schedule whose firings come closer than
    the minimum repeat is refused like ``every_seconds`` below it, and nothing is stored."""
    make_loop(ScriptedProvider(handler=CronAdder({"cron_expr": "* * * * * *", "message": "hi"})))
    client = FrontendClient(redis)
    await client.send(_msg("tick", "schedule it", "q1"))
    await collect(client, "web", {"q1"}, timeout_s=10)
    [tool_row] = [r for r in await _rows(redis, "web:tick") if r.get("role") == "tool"]
    stored = await redis.smembers(K.crons("web:tick"))
    nxt = [await redis.zscore(K.cron_due("web"), s) for s in stored]
    assert tool_row["content"].startswith("Error"), (
        f"a firing every second was scheduled: {tool_row['content']!r} (due {nxt})"
    )
    assert not stored


async def test_one_user_cannot_take_every_schedule_of_the_channel(redis, make_loop) -> None:  # type: ignore[no-untyped-def]
    """The other half of the subagent-slot finding: schedules were bounded per session
    (10) and per channel (10,000) only, and a session with schedules is never pruned, so a
    user with many chats (500 behind the gateway) could fill the channel's for good. A
    scope holds at most ``AGENT_CRON_MAX_PER_SCOPE``; another user still adds, and a
    schedule removed, fired for the last time or deleted with its chat frees its place."""
    loop = make_loop(ScriptedProvider(handler=CronAdder({"every_seconds": 3600, "message": "m"})),
                     cron_max_per_scope=2)  # fmt: skip
    client = FrontendClient(redis)

    async def add(user: str, chat: str) -> str:
        msg = InboundMessage(id=f"{chat}-{user}-{time.monotonic_ns()}", channel="web",
                             chat_id=chat, sender_id=user, scope=user, content="schedule it")  # fmt: skip
        await client.send(msg)
        await collect(client, "web", {msg.id}, timeout_s=10)
        return [r for r in await _rows(redis, f"web:{chat}") if r.get("role") == "tool"][-1][
            "content"
        ]

    assert (await add("mallory", "m0")).startswith("Scheduled")
    assert (await add("mallory", "m1")).startswith("Scheduled")
    refused = await add("mallory", "m2")
    assert refused.startswith("Error: this user's conversations hold 2 schedules"), refused
    assert (await add("alice", "a0")).startswith("Scheduled")
    assert await loop.sessions.delete_session("web:m0")  # its schedule goes with it
    assert (await add("mallory", "m2")).startswith("Scheduled")
    [sid] = await redis.smembers(K.crons("web:m1"))
    assert await loop.schedules.store.remove("web:m1", sid)
    assert (await add("mallory", "m3")).startswith("Scheduled")
    counts = await redis.hgetall(K.cron_per_scope("web"))
    assert counts == {"web/scope:mallory": "2", "web/scope:alice": "1"}, counts


async def test_a_frontends_user_with_many_scopes_takes_one_share_of_schedules(
    redis, make_loop
) -> None:  # type: ignore[no-untyped-def]
    """A bot behind the gateway's OpenAI endpoint names many end users, each a scope of
    its own (memory and session tools never cross between them). Counted by scope, each
    end user had a share of the per-scope limits: one gateway user could hold as many
    shares as end users they named (failed on 5f4bf8e). A session started by a message
    naming a ``quota`` counts against that owner's share; the first message decides it,
    and a session without one counts by its scope as before."""
    make_loop(ScriptedProvider(handler=CronAdder({"every_seconds": 3600, "message": "m"})),
              cron_max_per_scope=2)  # fmt: skip
    client = FrontendClient(redis)

    async def add(chat: str, scope: str, quota: str | None) -> str:
        msg = InboundMessage(id=f"{chat}-{time.monotonic_ns()}", channel="web", chat_id=chat,
                             sender_id="bot", scope=scope, quota=quota, content="schedule it")  # fmt: skip
        await client.send(msg)
        await collect(client, "web", {msg.id}, timeout_s=10)
        return [r for r in await _rows(redis, f"web:{chat}") if r.get("role") == "tool"][-1][
            "content"
        ]

    assert (await add("e1", "bot-oa-1", "bot")).startswith("Scheduled")
    assert (await add("e2", "bot-oa-2", "bot")).startswith("Scheduled")
    refused = await add("e3", "bot-oa-3", "bot")
    assert refused.startswith("Error: this user's conversations hold 2 schedules"), refused
    # the session's first message decided: a later one naming no quota changes nothing
    assert (await add("e1", "bot-oa-1", None)).startswith("Error: this user's"), "e1 again"
    assert (await add("a1", "alice", None)).startswith("Scheduled")  # others still add
    counts = await redis.hgetall(K.cron_per_scope("web"))
    assert counts == {"web/scope:bot": "2", "web/scope:alice": "1"}, counts


async def test_a_frontends_user_with_many_scopes_takes_one_share_of_subagent_sessions(
    redis, make_loop
) -> None:  # type: ignore[no-untyped-def]
    """The same for sessions running subagents (``AGENT_SUBAGENT_SESSIONS_PER_SCOPE``)."""
    model = SlowSubagents()  # (each runs until released)
    make_loop(ScriptedProvider(handler=model), followup_mode="queue",
              subagent_sessions_per_scope=1)  # fmt: skip
    client = FrontendClient(redis)
    results = []
    try:
        for chat in ("e1", "e2"):
            msg = InboundMessage(id=f"{chat}-q", channel="web", chat_id=chat, sender_id="bot",
                                 scope=f"bot-oa-{chat}", quota="bot", content="research slow")  # fmt: skip
            await client.send(msg)
            await collect(client, "web", {msg.id}, timeout_s=10)
            rows = await _rows(redis, f"web:{chat}")
            results += [r["content"] for r in rows if r.get("role") == "tool"]
        assert results[0].startswith("Subagent "), results
        assert results[1].startswith("Error: subagents are running in 1 of this user's"), results
    finally:
        model.release.set()


def test_a_five_field_cron_expression_is_held_to_the_operators_minimum_repeat() -> None:
    """Defect: an operator who raises ``AGENT_CRON_MIN_EVERY_S`` to an hour still gets
    a schedule every minute through ``cron_expr`` (``* * * * *``). Expected: refused with
    a reason, as ``every_seconds: 60`` is."""
    now = int(time.time() * 1000)
    args = {"message": "m", "cron_expr": "* * * * *"}
    with pytest.raises(ScheduleError):
        parse_schedule(args, sid="s", session="web:c", chat_id="c", min_every_s=3600, now=now)


# --- consolidation ----------------------------------------------------------------------

CONTEXT_CHARS = 60_000  # what the model in this test can take in one request


def _context_limited_model(folds: list[int]) -> Any:
    """A model with a context window: a request longer than ``CONTEXT_CHARS`` fails as an
    OpenAI-compatible server fails it (400 context_length_exceeded, after no retry)."""

    async def answer(**kw: Any) -> LLMResponse:
        size = sum(len(str(m.get("content") or "")) for m in kw["messages"])
        if kw.get("tools") is None and "Summarise" in kw["messages"][0]["content"]:
            folds.append(size)
            if size > CONTEXT_CHARS:
                raise ProviderError("400: context_length_exceeded")
            return LLMResponse(content=json.dumps({"memory": "facts", "history": "talked"}))
        return LLMResponse(content="ok")

    return answer


async def test_a_consolidation_backlog_larger_than_the_models_context_is_folded_in_parts(
    redis: aioredis.Redis,
) -> None:
    """Defect: a consolidation job folds every row not consolidated but the newest 8 in
    one model request, whatever their size (``Consolidator.maybe_consolidate_by_tokens``
    sets ``end = len - KEEP_RECENT``; ``fold`` sends ``_transcript(rows)`` whole). A
    backlog forms whenever folds fall behind (a job of a killed worker waits 15 minutes,
    a slow fold while a user sends 100,000-character messages, a model outage); once it
    is larger than the model's context every fold fails, every later turn queues one that
    sends the whole (growing) backlog again, and the session is never consolidated: cost
    per turn in proportion to the whole history, for good. Expected: a fold takes a
    bounded part of the backlog (about the consolidation threshold) and the job goes on
    part by part, so the backlog is consolidated."""
    folds: list[int] = []
    config = LoopConfig(consolidate_above_tokens=2_000, read_block_ms=100)
    loop = AgentLoop(RedisBus(redis), ScriptedProvider(handler=_context_limited_model(folds)),
                     config=config)  # fmt: skip
    rows: list[dict[str, Any]] = []
    for i in range(0, 2000, 2):  # ~200,000 characters never consolidated
        rows.append({"role": "user", "content": f"old {i} " + "x" * 90, "message_id": f"id{i}"})
        rows.append({"role": "assistant", "content": f"answer {i} " + "y" * 90})
    await loop.sessions.store.save(Session(key="web:big", messages=rows, scope=SCOPE))
    for n in range(3):  # three more turns, each queueing a consolidation
        await loop.process_message(_msg("big", f"hello {n}", f"h{n}"))
        await loop.jobs.aclose()  # wait for the job
    assert folds, "no consolidation was attempted"
    assert await _last_consolidated(redis, "web:big") > 0, (
        f"never consolidated: every fold sent the whole backlog ({folds} characters) and failed"
    )
    assert max(folds) <= CONTEXT_CHARS


# --- subagents --------------------------------------------------------------------------


async def test_a_spawn_whose_job_was_not_queued_leaves_no_registration_behind(
    redis, make_loop
) -> None:  # type: ignore[no-untyped-def]
    """Defect: ``Subagents.spawn`` registers the subagent (``spawn_add.lua``) and only then
    queues its job; when queueing fails (a Redis blip on arq's connection, a full Redis)
    the tool answers an error, but the registration stays, state ``queued``, for its hour
    of TTL: no job will ever run it, ``rerun_orphans`` only looks at ``running`` ones, and
    it holds one of the session's slots (and one of the channel's 8). The same happens
    after a kill -9 between the two (the re-run replays the call as of unknown effect).
    Expected: a registration whose job was not queued is dropped (or queued later), so
    the conversation can spawn again at once."""
    loop = make_loop(ScriptedProvider(handler=Spawner()), followup_mode="queue",
                     subagents_per_session=1)  # fmt: skip
    failed = _first_subagent_enqueue(loop.rt.jobs, _connection_reset)
    client = FrontendClient(redis)
    await client.send(_msg("sp", "research one", "q1"))
    await collect(client, "web", {"q1"}, timeout_s=10)
    assert failed
    await client.send(_msg("sp", "research two", "q2"))
    await collect(client, "web", {"q2"}, timeout_s=10)
    tool_rows = [r["content"] for r in await _rows(redis, "web:sp") if r.get("role") == "tool"]
    assert tool_rows[1].startswith("Subagent "), (
        f"the second spawn was refused: {tool_rows[1]!r}; left registered: "
        f"{await redis.hgetall(K.spawned('web:sp'))}"
    )
    await until(lambda: _has_spawn_reply(client, "web:sp"), timeout_s=10)


async def test_a_spawn_whose_worker_died_before_queueing_its_job_runs_once_taken_over(
    redis, make_loop
) -> None:  # type: ignore[no-untyped-def]
    """The worker registered a subagent and died before its job reached the queue (here:
    the enqueue never happens). The registration says ``queued`` by that worker; whoever
    takes over what it left (a survivor, or itself restarted) queues the job, and the
    result comes back (it used to hold the session's slot for an hour, never run)."""
    loop = make_loop(ScriptedProvider(handler=Spawner()), followup_mode="queue")
    lost = _first_subagent_enqueue(loop.rt.jobs, _never_sent)
    client = FrontendClient(redis)
    await client.send(_msg("sq", "research one", "q1"))
    await collect(client, "web", {"q1"}, timeout_s=10)
    assert lost
    assert not await spawn_replies(client, "web:sq")
    await loop.subagents.rerun_orphans(loop.worker_id, {"web"})
    await until(lambda: _has_spawn_reply(client, "web:sq"), timeout_s=10)
    assert len(await spawn_replies(client, "web:sq")) == 1


def _first_subagent_enqueue(jobs: Any, instead: Callable[[], Awaitable[bool]]) -> list[str]:
    """The first subagent job's enqueue does ``instead()``; the job ids it was asked for."""
    real, first = jobs.enqueue, []

    async def enqueue(name: str, **kw: Any) -> bool:
        if name == "subagent" and not first:
            first.append(kw["job_id"])
            return await instead()
        return bool(await real(name, **kw))

    jobs.enqueue = enqueue
    return first


async def _connection_reset() -> bool:
    raise RedisConnectionError("Connection reset by peer")


async def _never_sent() -> bool:
    return True  # (the process was gone before this reached Redis)


async def _has_spawn_reply(client: FrontendClient, session: str) -> bool:
    return bool(await spawn_replies(client, session))


async def test_a_blank_spawn_label_falls_back_to_the_task(redis, make_loop) -> None:  # type: ignore[no-untyped-def]
    """Defect (malformed input): ``label`` of only blanks or a newline makes
    ``(label or task).strip().splitlines()[0]`` raise IndexError: the model gets
    "Error: spawn failed: IndexError" for a valid task. Expected: the label is optional,
    a blank one is taken as absent (the task names the subagent) and it starts."""
    make_loop(ScriptedProvider(handler=Spawner(label=" \n ")), followup_mode="queue")
    client = FrontendClient(redis)
    await client.send(_msg("lb", "research the answer", "q1"))
    await collect(client, "web", {"q1"}, timeout_s=10)
    [tool_row] = [r for r in await _rows(redis, "web:lb") if r.get("role") == "tool"]
    assert tool_row["content"].startswith("Subagent "), tool_row["content"]


class SlowSubagents(Spawner):
    """As ``Spawner``, but every subagent waits for ``release`` (a long task)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()
        self.started = 0

    async def __call__(self, **kw: Any) -> LLMResponse:
        last = kw["messages"][-1]
        if last["role"] == "user" and last["content"].startswith("Task"):
            self.started += 1
            await self.release.wait()
        return await super().__call__(**kw)


async def test_one_user_cannot_take_every_subagent_slot_of_the_channel(redis, make_loop) -> None:  # type: ignore[no-untyped-def]
    """Defect (a hostile end user): the only bound across sessions is per channel
    (``AGENT_SUBAGENT_SESSIONS_PER_CHANNEL``, 8), with nothing per scope. One gateway user
    (500 chats allowed) asks in 8 of their chats for a long task (a subagent runs up to
    ``AGENT_SUBAGENT_TIMEOUT_S``, and is asked for again when it ends): every other user of
    the channel is refused ``spawn`` for as long as they keep it up. (The cron tool has
    the same shape: 500 chats x 10 schedules per user, 10,000 per channel, and a session
    with schedules is never pruned: two users lock everyone else out of ``cron`` for
    good.) Expected: one scope holds at most a share of the channel's slots, so a user of
    another scope can still spawn."""
    model = SlowSubagents()
    make_loop(ScriptedProvider(handler=model), followup_mode="queue")
    client = FrontendClient(redis)
    ids = set()
    for i in range(8):  # the hostile user's chats: scope web/scope:mallory
        msg = InboundMessage(id=f"m{i}", channel="web", chat_id=f"mal{i}", sender_id="mallory",
                             scope="mallory", content=f"research slow {i}")  # fmt: skip
        ids.add(await client.send(msg))
    await collect(client, "web", ids, timeout_s=10)
    honest = InboundMessage(id="a1", channel="web", chat_id="alice", sender_id="alice",
                            scope="alice", content="research the answer")  # fmt: skip
    await client.send(honest)
    await collect(client, "web", {"a1"}, timeout_s=10)
    try:
        [tool_row] = [r for r in await _rows(redis, "web:alice") if r.get("role") == "tool"]
        assert tool_row["content"].startswith("Subagent "), (
            f"another user was refused: {tool_row['content']!r}"
        )
    finally:
        model.release.set()


# --- session tools ----------------------------------------------------------------------


async def test_read_session_never_returns_rows_of_another_scope_read_across_a_recreation(
    redis: aioredis.Redis,
) -> None:
    """Defect: ``read_session`` (and ``search_sessions``) read a stored session without its
    lease in two round trips (``RedisSessionStore._load_tail``: ``meta``/``count``, then
    the rows) and check the scope of the first read only. A chat deleted and started again
    by a sender of another scope in between (the case consolidation guards against with
    its generation check) hands the rows of the new owner to the reader, labelled with the
    old owner's scope. Expected: the rows returned are those of the session whose scope
    was checked (one atomic read, or the generation read again after the rows), else
    "No stored session"."""
    loop = AgentLoop(RedisBus(redis), ScriptedProvider([]), config=LoopConfig(read_block_ms=100))
    store = loop.sessions.store
    alice, bob = "web/scope:alice", "web/scope:bob"
    old = [{"role": "user", "content": f"alice row {i}"} for i in range(4)]
    await store.save(Session(key="web:group", messages=old, scope=alice))
    rows_read = Gate(store._hmget, when=lambda _k, fields: fields[0].startswith("m:"))
    store._hmget = rows_read  # type: ignore[method-assign]
    ctx = ToolContext(Session(key="web:mine", scope=alice), loop.sessions, emit=_quiet)
    read = asyncio.create_task(ReadSessionTool().execute(ctx, session_key="web:group"))
    await rows_read.wait_reached()
    # meanwhile: the chat is deleted and bob's first messages start it again
    store._hmget = rows_read.target  # type: ignore[method-assign]
    assert await loop.sessions.delete_session("web:group")
    new = [{"role": "user", "content": f"BOB SECRET {i}"} for i in range(4)]
    await store.save(Session(key="web:group", messages=new, scope=bob))
    rows_read.go.set()
    result = await asyncio.wait_for(read, 10)
    assert "BOB SECRET" not in result, f"alice's tool read bob's rows: {result}"
    await loop.jobs.aclose()


async def _quiet(_text: str) -> None:
    return None


async def test_a_users_share_of_subagent_slots_frees_when_their_subagent_ends(
    redis, make_loop
) -> None:  # type: ignore[no-untyped-def]
    """The share a scope holds counts sessions with subagents running: once one ended (its
    result published), the user's next conversation may spawn; a deleted conversation's
    share goes with it too."""
    make_loop(ScriptedProvider(handler=Spawner()), followup_mode="queue",
              subagent_sessions_per_scope=1)  # fmt: skip
    client = FrontendClient(redis)
    for chat in ("one", "two"):
        msg = InboundMessage(id=f"{chat}-q", channel="web", chat_id=chat, sender_id="bob",
                             scope="bob", content="research it")  # fmt: skip
        await client.send(msg)
        await collect(client, "web", {msg.id}, timeout_s=10)
        [tool_row] = [r for r in await _rows(redis, f"web:{chat}") if r.get("role") == "tool"]
        assert tool_row["content"].startswith("Subagent "), tool_row["content"]
        await until(lambda c=chat: _has_spawn_reply(client, f"web:{c}"), timeout_s=10)
    assert not await redis.hlen(K.subagent_scopes("web"))


async def test_a_subagents_start_renews_its_registration(redis) -> None:  # type: ignore[no-untyped-def]
    """A minor finding of the review: the registration's TTL (an hour) ran from the spawn;
    a job that started late (a busy queue) could lose its registration mid-run and then
    publish nothing. Its start renews it."""
    from bus_redis.subagents import REGISTRATION_TTL_MS, SubagentStore

    bus = RedisBus(redis)
    store = SubagentStore(bus)
    await redis.set(K.lease("web:t"), "n|w", px=10_000)
    doc = json.dumps({"id": "s1", "session": "web:t", "state": "queued"})
    added = await store.add("web:t", "n|w", "web:t", "s1", doc, limit=2, channel_limit=8,
                            scope="web/scope:u", scope_limit=2)  # fmt: skip
    assert added == 1
    await redis.pexpire(K.spawned("web:t"), 1_000)  # the hour almost over when it starts
    assert await store.running("web:t", "s1", doc)
    assert await redis.pttl(K.spawned("web:t")) > REGISTRATION_TTL_MS - 60_000
    await bus.aclose()
