"""The agent's tools and memory as a cross-user boundary, as a hostile reviewer attacked
them: a consolidation racing a re-created chat, tool arguments and the size of tool results."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aioredis
from helpers import ScriptedProvider
from replies import wait_until_async

from bus_redis import InboundMessage, RedisBus
from session_store import Session
from worker import AgentLoop, LoopConfig
from worker.agent.providers import LLMResponse, ToolCallRequest
from worker.agent.tools import ToolContext, default_registry

SECRET = "xavier's locker code is 8812"


def _folding_provider(gate: asyncio.Event) -> ScriptedProvider:
    """Answers turns with "ok"; a consolidation fold waits for ``gate`` and returns the
    conversation it was given as the new memory (as a faithful summariser would)."""

    async def handler(**kw: Any) -> LLMResponse:
        system = kw["messages"][0]["content"]
        if kw.get("tools") is None and "Summarise" in system:
            await gate.wait()
            convo = kw["messages"][-1]["content"].split("# Conversation\n", 1)[1]
            return LLMResponse(content=json.dumps({"memory": convo, "history": "a chat"}))
        return LLMResponse(content="ok")

    return ScriptedProvider(handler=handler)


async def _no_emit(_text: str) -> None:
    return None


async def test_a_consolidation_never_writes_one_users_conversation_into_anothers_memory(
    redis: aioredis.Redis,
) -> None:
    """A consolidation job folds the rows it read (without the lease) and commits under
    the lease into the scope of the session it finds *then*. When the chat key was
    deleted meanwhile and started again by another sender (a shared group chat of a bot
    frontend: scopes are per sender), the fold of xavier's conversation is written into
    yolanda's memory, and yolanda's rows are marked consolidated without being read."""
    gate = asyncio.Event()
    provider = _folding_provider(gate)
    loop = AgentLoop(RedisBus(redis), provider, config=LoopConfig())
    for i in range(4):  # xavier's conversation in the group chat
        content = SECRET if i == 0 else f"xavier says {i}"
        await loop.process_message(
            InboundMessage(id=f"x{i}", channel="web", sender_id="xavier", chat_id="group",
                           content=content)
        )  # fmt: skip
    job = asyncio.create_task(loop.consolidator.run_job(key="web:group", start=0, end=4))
    assert await wait_until_async(lambda: _started(provider), timeout_s=10)  # folding

    # meanwhile the chat is deleted (the frontend's delete, or the idle prune) and the
    # next member of the group starts a fresh conversation under her own scope
    assert await loop.sessions.delete_session("web:group")
    for i in range(3):
        await loop.process_message(
            InboundMessage(id=f"y{i}", channel="web", sender_id="yolanda", chat_id="group",
                           content=f"yolanda says {i}")
        )  # fmt: skip
    gate.set()
    await asyncio.wait_for(job, 10)

    yolanda = loop.rt.scope_for("web", None, "yolanda")
    assert SECRET not in await loop.memory.read_memory(yolanda)
    stored = await loop.sessions.store.load("web:group")
    assert stored is not None
    assert stored.last_consolidated == 0


async def _started(provider: ScriptedProvider) -> bool:
    return any(c.get("tools") is None for c in provider.calls)


def _long_session(rows: int, size: int = 10) -> Session:
    session = Session(key="web:long", scope="web/sender:u")
    for i in range(rows // 2):
        session.add_message("user", f"q{i} " + "x" * size)
        session.add_message("assistant", f"a{i} " + "y" * size)
    return session


async def test_read_session_never_returns_more_rows_than_its_schema_allows(
    redis: aioredis.Redis,
) -> None:
    """The tool's schema says ``limit`` is 1..200, but the arguments are the model's (a
    prompt-injected one's): nothing enforces the range. ``limit: 0`` (``rows[-0:]``) or a
    negative limit returns the whole history, however long."""
    loop = AgentLoop(RedisBus(redis), ScriptedProvider(), config=LoopConfig())
    session = _long_session(600)
    ctx = ToolContext(session, loop.sessions, emit=_no_emit)
    registry = default_registry()
    for limit in (0, -1, 10_000, True, "9999"):
        out = await registry.execute("read_session", {"limit": limit}, ctx)
        assert out.startswith("Error: bad arguments for read_session: 'limit' must"), out[:80]
    rows = json.loads(await registry.execute("read_session", {"limit": 200}, ctx))
    assert 100 < len(rows) <= 200
    assert rows[-1]["content"].startswith("a299 ")
    unnamed = json.loads(await registry.execute("read_session", {"rows": 5}, ctx))
    assert len(unnamed) == 20  # a property the schema does not name is left out
    session.add_message("user", "huge " + "h" * 50_000)
    rows = json.loads(await registry.execute("read_session", {"limit": 5}, ctx))
    assert [r["content"][:5] for r in rows] == ["huge "]  # cut to fit, still JSON


@contextlib.asynccontextmanager
async def _compose_like_redis() -> AsyncIterator[aioredis.Redis]:
    """A redis-server of its own with docker-compose.yml's ``--proto-max-bulk-len 1mb``."""
    from servers import RedisServer, require_redis_server

    require_redis_server()
    server = RedisServer(extra=["--proto-max-bulk-len", "1mb"]).start()
    client = aioredis.from_url(server.url, decode_responses=True)
    try:
        await client.sadd("agent:channels", "web")
        yield client
    finally:
        await client.aclose()
        server.cleanup()


async def _written(loop: AgentLoop, msg: InboundMessage, what: str) -> None:
    """``msg``'s turn ran and was written (a script argument over the bulk limit fails
    the call, and the server drops the connection it came on)."""
    try:
        reply = await loop.process_message(msg)
    except Exception as exc:
        detail = f"{type(exc).__name__}: {str(exc)[:120]}"
        raise AssertionError(f"{what} could not be written: {detail}") from None
    assert reply is not None
    assert reply.type == "message"


async def test_a_read_session_result_fits_the_deployments_bulk_limit() -> None:
    """Tool results are not bounded in bytes: read_session returns up to 200 whole rows
    (each may be a 256 KiB message), and the result is one row written to the tool
    journal and the session hash as one script argument. docker-compose.yml runs Redis
    with ``--proto-max-bulk-len 1mb`` (as docs/SECURITY.md advises), so twelve legitimate
    long messages and one "read my session back" make a turn that can never be written:
    it fails on every delivery (the RAW archive entry is capped for exactly this reason)."""
    async with _compose_like_redis() as client:

        async def handler(**kw: Any) -> LLMResponse:
            last = kw["messages"][-1]
            if last.get("role") == "user" and "read it back" in str(last.get("content")):
                return LLMResponse(
                    tool_calls=[ToolCallRequest("c1", "read_session", {"limit": 200})]
                )
            return LLMResponse(content="ok")

        loop = AgentLoop(RedisBus(client), ScriptedProvider(handler=handler), config=LoopConfig())
        for i in range(12):  # each within the gateway's 100,000 characters a message
            await loop.process_message(
                InboundMessage(id=f"m{i}", channel="web", sender_id="u", chat_id="c",
                               content=f"part {i} " + "z" * 99_000)
            )  # fmt: skip
        ask = InboundMessage(id="r", channel="web", sender_id="u", chat_id="c",
                             content="read it back")  # fmt: skip
        await _written(loop, ask, "the turn")


async def test_one_search_reads_a_bounded_number_of_session_records(
    real_redis: aioredis.Redis,
) -> None:
    """search_sessions looks at 100 sessions at most, but first lists the whole scope:
    ``list_sessions(scope)`` reads every member of the scope's index and pipelines an
    HMGET of every session's record, then keeps 100 (``max_sessions: 1`` changes
    nothing). A scope's size is what its frontend wrote (a bot frontend opens a session
    per chat; a vouched workspace holds every member's): each call of a read-only tool, 20
    per turn, costs Redis and the worker work and memory in proportion to it."""
    loop = AgentLoop(RedisBus(real_redis), ScriptedProvider(), config=LoopConfig())
    scope = "web/sender:u"
    for i in range(3000):
        session = Session(key=f"web:chat-{i}", scope=scope)
        session.add_message("user", f"note {i}")
        await loop.sessions.store.save(session)
    here = Session(key="web:here", scope=scope)
    ctx = ToolContext(here, loop.sessions, emit=_no_emit)

    before = await _calls(real_redis, "hmget")
    await default_registry().execute(
        "search_sessions", {"query": "note 2999", "max_sessions": 1}, ctx
    )
    read = await _calls(real_redis, "hmget") - before
    assert read <= 100, f"one search read {read} session records"


async def _calls(redis: aioredis.Redis, command: str) -> int:
    stats = await redis.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


async def test_goals_a_model_records_keep_the_session_writable() -> None:
    """``create_goal`` keeps every goal, with a title of any length, in the session's
    metadata, which every commit rewrites whole as one script argument; nothing bounds
    the number of goals or a title's length, and no tool removes a goal. A model told
    (by its user, or by text it read) to "record goals" grows the metadata by what it can
    write in 20 calls a turn (~285 KB here): each turn rewrites all of it, and the turn
    that takes it past the compose file's proto-max-bulk-len (1 MB) can never be written
    (the server also drops the connection it came on: a worker's shared one)."""
    async with _compose_like_redis() as client:

        async def handler(**kw: Any) -> LLMResponse:
            messages = kw["messages"]
            last_user = max(i for i, m in enumerate(messages) if m.get("role") == "user")
            asked = "record goals" in str(messages[last_user].get("content"))
            calls = sum(1 for m in messages[last_user:] if m.get("role") == "tool")
            if asked and calls < 19:  # a model call's worth of title (~4,000 tokens) each
                title = f"goal {calls}: " + "plan " * 3_000
                return LLMResponse(tool_calls=[ToolCallRequest(f"g{calls}", "create_goal",
                                                               {"title": title})])  # fmt: skip
            return LLMResponse(content="ok")

        loop = AgentLoop(RedisBus(client), ScriptedProvider(handler=handler), config=LoopConfig())
        for i in range(4):
            msg = InboundMessage(id=f"g{i}", channel="web", sender_id="u", chat_id="c",
                                 content="record goals")  # fmt: skip
            await _written(loop, msg, f"turn {i}")


async def test_goals_are_bounded_in_number_and_length(redis: aioredis.Redis) -> None:
    """At most MAX_GOALS goals of at most TITLE_MAX_CHARS: past the cap a new goal
    replaces the oldest closed one; with every goal open it is refused."""
    from worker.agent.tools.goals import MAX_GOALS, TITLE_MAX_CHARS

    loop = AgentLoop(RedisBus(redis), ScriptedProvider(), config=LoopConfig())
    session = Session(key="web:g", scope="web/sender:u")
    ctx = ToolContext(session, loop.sessions, emit=_no_emit)
    registry = default_registry()
    long = await registry.execute("create_goal", {"title": "x" * (TITLE_MAX_CHARS + 1)}, ctx)
    assert long.startswith("Error: bad arguments for create_goal: 'title' must have at most")
    ids = []
    for i in range(MAX_GOALS):
        ctx.call_id = f"c{i}"
        ids.append(json.loads(await registry.execute("create_goal", {"title": f"g{i}"}, ctx))["id"])
    ctx.call_id = "one more"
    refused = await registry.execute("create_goal", {"title": "one more"}, ctx)
    assert refused.startswith("Error:")
    assert len(session.metadata["goals"]) == MAX_GOALS
    await registry.execute("update_goal", {"goal_id": ids[3], "status": "done"}, ctx)
    added = json.loads(await registry.execute("create_goal", {"title": "one more"}, ctx))
    goals = session.metadata["goals"]
    assert len(goals) == MAX_GOALS
    assert goals[-1] == added
    assert ids[3] not in [g["id"] for g in goals]  # the closed one made room


class _Counter:
    """A tool whose arguments are all optional: run with none, it still acts."""

    name = "count"
    description = "count"
    parameters: dict[str, Any] = {"type": "object", "properties": {"step": {"type": "integer"}}}

    def __init__(self) -> None:
        self.runs: list[dict[str, Any]] = []

    async def execute(self, ctx: ToolContext, **kw: Any) -> str:
        self.runs.append(kw)
        return "counted"


async def test_a_call_whose_arguments_are_not_json_never_runs_on_defaults(
    redis: aioredis.Redis,
) -> None:
    """Cut or garbled arguments are answered with an error the model can read; the tool
    does not run with its defaults, and the stored call keeps the text the model sent."""
    counter = _Counter()
    tools = default_registry()
    tools.register(counter)
    steps = [
        LLMResponse(tool_calls=[ToolCallRequest("c1", "count", {}, malformed='{"step": ')]),
        LLMResponse(content="done"),
    ]

    async def handler(**_kw: Any) -> LLMResponse:
        return steps.pop(0)

    provider = ScriptedProvider(handler=handler)
    loop = AgentLoop(RedisBus(redis), provider, tools=tools)
    reply = await loop.process_message(
        InboundMessage(channel="web", sender_id="u", chat_id="cut", content="count")
    )
    assert reply is not None
    assert reply.content == "done"
    assert counter.runs == []
    result = provider.calls[1]["messages"][-1]
    assert result["role"] == "tool"
    assert "not a JSON object" in result["content"]
    session = await loop.sessions.store.load("web:cut")
    assert session is not None
    call = next(m for m in session.messages if m.get("tool_calls"))
    assert call["tool_calls"][0]["function"]["arguments"] == '{"step": '
