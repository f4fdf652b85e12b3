"""Subagents (the ``spawn`` tool, ``worker.jobs.subagents``): a task runs as a background
job with its own bounded tools, and its result returns into the session that spawned it
as a system message, answered there; a stop aborts it (nothing comes back); a session
runs a bounded number at once. In-process on fakeredis and a real redis-server; across
two worker processes on a real one, with ``agent-worker status`` listing what runs."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from helpers import ScriptedProvider, run_cli
from replies import channel_events, collect, until

from bus_redis import FrontendClient, InboundMessage, Keys
from worker.agent.providers import LLMResponse, ToolCallRequest

K = Keys()


def _m(chat: str, text: str, id_: str) -> InboundMessage:
    return InboundMessage(id=id_, channel="web", chat_id=chat, sender_id="u", content=text)


class Model:
    """The parent spawns on "research ..."; a subagent (its prompt starts with "Task")
    waits for ``release`` when its task says "slow"; the rest is echoed."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.subagent_started = asyncio.Event()
        self.subagent_tools: list[str] = []
        self.cancelled = 0
        self.spawns = 0

    async def __call__(self, **kw: Any) -> LLMResponse:
        messages = kw["messages"]
        last = messages[-1]
        if last["role"] == "user" and last["content"].startswith("research"):
            self.spawns += 1
            task = last["content"].removeprefix("research").strip()
            call = ToolCallRequest(f"c{self.spawns}", "spawn", {"task": task, "label": "r"})
            return LLMResponse(tool_calls=[call])
        if last["role"] == "user" and last["content"].startswith("Task"):
            self.subagent_tools = [t["function"]["name"] for t in kw.get("tools") or []]
            self.subagent_started.set()
            if "slow" in last["content"]:
                try:
                    await self.release.wait()
                except asyncio.CancelledError:
                    self.cancelled += 1
                    raise
            return LLMResponse(content="found: 42")
        return LLMResponse(content=f"re: {last['content']}")


async def test_a_subagents_result_comes_back_into_its_session(redis, make_loop) -> None:  # type: ignore[no-untyped-def]
    model = Model()
    make_loop(ScriptedProvider(handler=model), followup_mode="queue")
    client = FrontendClient(redis)
    await client.send(_m("sa", "research the answer", "q1"))
    got = await collect(client, "web", {"q1"}, timeout_s=10)
    assert [e.type for e in got["q1"] if e.is_terminal] == ["message"]

    async def results() -> list[str]:
        return await _spawn_replies(client, "web")

    await until(lambda: _some(results), timeout_s=10)
    [rid] = await results()
    got = await collect(client, "web", {rid}, timeout_s=10)
    [answer] = [e for e in got[rid] if e.is_terminal]
    assert answer.session_key == "web:sa"
    assert "found: 42" in (answer.content or "")
    stored = await redis.hget(K.session("web:sa"), "meta")
    assert json.loads(stored)["scope"] == "web/sender:u"  # the session's scope, unchanged
    assert sorted(model.subagent_tools) == ["read_session", "search_sessions"]
    assert not await redis.exists(K.spawned("web:sa"))  # unregistered once done
    assert await redis.zscore(K.subagents("web"), "web:sa") is None


async def _some(results: Any) -> bool:
    return bool(await results())


async def _spawn_replies(client: FrontendClient, channel: str, session: str = "") -> list[str]:
    """The ids of the subagent results answered in ``channel`` (or in one session)."""
    events = await channel_events(client, channel)
    return [
        e.reply_to or ""
        for e in events
        if (e.reply_to or "").startswith("spawn:") and session in ("", e.session_key)
    ]


async def _rows(redis: Any, key: str) -> list[dict[str, Any]]:
    """A stored session's rows, in order."""
    stored = await redis.hgetall(K.session(key))
    return [
        json.loads(v)
        for _, v in sorted((int(f[2:]), v) for f, v in stored.items() if f.startswith("m:"))
    ]


async def test_stop_aborts_a_running_subagent_and_nothing_comes_back(redis, make_loop) -> None:  # type: ignore[no-untyped-def]
    model = Model()
    loop = make_loop(ScriptedProvider(handler=model), followup_mode="queue")
    client = FrontendClient(redis)
    await client.send(_m("st", "research slow thing", "q1"))
    await collect(client, "web", {"q1"}, timeout_s=10)
    await asyncio.wait_for(model.subagent_started.wait(), 10)
    assert await redis.hlen(K.spawned("web:st")) == 1
    await client.stop("web:st")
    await until(lambda: model.cancelled == 1, timeout_s=10)
    await until(lambda: _unregistered(redis, "web:st"), timeout_s=10)
    model.release.set()
    await client.send(_m("st", "after", "q2"))  # the session goes on
    got = await collect(client, "web", {"q2"}, timeout_s=10)
    assert [e.type for e in got["q2"] if e.is_terminal] == ["message"]
    assert not loop.subagents.running
    assert await _spawn_replies(client, "web") == []


async def _unregistered(redis: Any, session: str) -> bool:
    return not await redis.exists(K.spawned(session))


async def test_a_session_runs_a_bounded_number_of_subagents(redis, make_loop) -> None:  # type: ignore[no-untyped-def]
    model = Model()
    make_loop(ScriptedProvider(handler=model), followup_mode="queue", subagents_per_session=1)
    client = FrontendClient(redis)
    await client.send(_m("bd", "research slow one", "q1"))
    await collect(client, "web", {"q1"}, timeout_s=10)
    await asyncio.wait_for(model.subagent_started.wait(), 10)
    await client.send(_m("bd", "research slow two", "q2"))
    await collect(client, "web", {"q2"}, timeout_s=10)
    results = [r["content"] for r in await _rows(redis, "web:bd") if r.get("role") == "tool"]
    assert results[0].startswith("Subagent ")
    assert results[1] == "Error: 1 subagents of this conversation are running; wait for one"
    assert await redis.hlen(K.spawned("web:bd")) == 1
    model.release.set()


# --- two worker processes (real redis-server) ---------------------------------------------


@pytest.mark.real_redis
@pytest.mark.slow
async def test_spawn_across_two_workers_listed_by_status_and_aborted_by_stop(
    real_redis, redis_server, spawn_workers, fake_llm
) -> None:  # type: ignore[no-untyped-def]
    """Two sessions spawn a subagent each; the fake model holds both ("block" in their
    tasks, escaped in the parent's text). ``status`` lists them running; a stop of one
    session aborts its subagent wherever it runs; the other's result arrives in its own
    session once released."""
    spawn_workers(2, env={"AGENT_FOLLOWUP_MODE": "queue"})
    held: list[str] = []  # the subagents' model calls the fake server holds
    fake_llm.on_block = held.append
    client = FrontendClient(real_redis)
    for chat in ("keep", "stop"):
        args = '{"task": "bl\\u006fck ' + chat + '", "label": "' + chat + '"}'
        await client.send(_m(chat, f"toolcall:spawn{args}", chat))
    await collect(client, "web", {"keep", "stop"}, timeout_s=30)
    cli_env = {"AGENT_REDIS_URL": redis_server.url}

    async def running() -> list[dict[str, Any]]:
        out = await asyncio.to_thread(run_cli, "status", "--json", env=cli_env)
        return [s for s in json.loads(out.stdout)["subagents"] if s["state"] == "running"]

    await until(lambda: _n(running, 2), timeout_s=30)
    listed = await running()
    assert {s["session"] for s in listed} == {"web:keep", "web:stop"}
    assert {s["worker"] for s in listed} <= {"w0", "w1"}
    # listed as running as soon as registered: stop once both model calls are held, so
    # that the stop cuts a call in flight (not one about to be sent)
    await until(
        lambda: {c for c in ("keep", "stop") if any(c in t for t in held)} == {"keep", "stop"},
        timeout_s=30,
    )
    await client.stop("web:stop")
    await until(lambda: fake_llm.hangups >= 1, timeout_s=10)  # its model call was cut
    await until(lambda: _unregistered(real_redis, "web:stop"), timeout_s=10)
    fake_llm.release()

    async def result_of(chat: str) -> list[str]:
        return await _spawn_replies(client, "web", f"web:{chat}")

    await until(lambda: _n(result_of, 1, "keep"), timeout_s=30)
    [rid] = await result_of("keep")
    got = await collect(client, "web", {rid}, timeout_s=30)
    [answer] = [e for e in got[rid] if e.is_terminal]
    assert answer.session_key == "web:keep"
    assert "[subagent " in (answer.content or "")
    await client.send(_m("stop", "after", "after"))
    await collect(client, "web", {"after"}, timeout_s=30)
    assert await result_of("stop") == []


async def _n(fn: Any, n: int, *args: Any) -> bool:
    return len(await fn(*args)) >= n


async def test_a_channel_full_of_subagents_leaves_another_channel_served(redis, make_loop) -> None:  # type: ignore[no-untyped-def]
    """A channel whose sessions hold every subagent slot it may (one session here) gets a
    refusal for a further session; another channel's sessions still spawn, and get their
    results."""
    model = Model()
    make_loop(
        ScriptedProvider(handler=model), followup_mode="queue", subagent_sessions_per_channel=1
    )
    client = FrontendClient(redis)
    await client.send(_m("a1", "research slow one", "q1"))
    await collect(client, "web", {"q1"}, timeout_s=10)
    await asyncio.wait_for(model.subagent_started.wait(), 10)
    await client.send(_m("a2", "research slow two", "q2"))
    await collect(client, "web", {"q2"}, timeout_s=10)
    [refusal] = [r["content"] for r in await _rows(redis, "web:a2") if r.get("role") == "tool"]
    assert refusal.startswith("Error: too many subagents are running")
    other = InboundMessage(
        id="o1", channel="cli", chat_id="b", sender_id="u", content="research quick"
    )
    await client.send(other)

    async def result() -> list[str]:
        return await _spawn_replies(client, "cli")

    await until(lambda: _some(result), timeout_s=10)
    model.release.set()


async def test_a_failing_subagent_reports_it_and_frees_its_slot(redis, make_loop) -> None:  # type: ignore[no-untyped-def]
    model = Model()

    async def broken(**kw: Any) -> LLMResponse:
        if kw["messages"][-1]["content"].startswith("Task"):
            raise RuntimeError("the subagent's model broke")
        return await model(**kw)

    make_loop(ScriptedProvider(handler=broken), followup_mode="queue")
    client = FrontendClient(redis)
    await client.send(_m("fl", "research doomed", "q1"))
    await collect(client, "web", {"q1"}, timeout_s=10)

    async def results() -> list[str]:
        return await _spawn_replies(client, "web")

    await until(lambda: _some(results), timeout_s=10)
    [rid] = await results()
    await collect(client, "web", {rid}, timeout_s=10)
    rows = await _rows(redis, "web:fl")
    assert any("failed: RuntimeError" in str(r.get("content")) for r in rows)
    assert not await redis.exists(K.spawned("web:fl"))


async def test_a_worker_that_heard_the_stop_never_starts_an_older_subagent(redis) -> None:  # type: ignore[no-untyped-def]
    """The job of a subagent queued before a stop starts on a worker that heard the stop
    (not the spawner): it drops itself. A subagent spawned after the stop is not touched."""
    from bus_redis import ControlMessage, RedisBus
    from worker import AgentLoop

    heard = AgentLoop(RedisBus(redis), ScriptedProvider(handler=Model()))
    store = heard.subagents.store
    await redis.set(K.lease("web:h"), "n|w", px=10_000)
    for sid, after in (("old", "100-0"), ("new", "300-0")):
        doc = {"id": sid, "session": "web:h", "channel": "web", "chat_id": "h", "scope": "web/u",
               "label": sid, "task": "t", "after": after}  # fmt: skip
        assert await store.add("web:h", "n|w", "web:h", sid, json.dumps(doc), limit=3,
                               channel_limit=8, scope="web/u", scope_limit=2) == 1  # fmt: skip
    heard.subagents.aborts.remember(
        "web:h"
    )  # it spawned them: it unregisters those the stop covers
    heard.subagents.on_control(ControlMessage(op="stop", session_key="web:h", marker="200-0"))
    await asyncio.gather(*heard.rt.background)
    assert set(await store.of_session("web:h")) == {"new"}  # spawned after the stop: kept
    await heard.subagents.run_job(session="web:h", sid="old")  # (unregistered: nothing)
    assert not await redis.exists(K.inbound("web:h"))
    await heard.jobs.aclose()


async def test_the_spawners_unregistration_survives_a_redis_blip(redis) -> None:  # type: ignore[no-untyped-def]
    """A stop reaches the worker that spawned a subagent not started yet; its look at the
    registrations fails once (a blip). It used to log a warning and give up: the
    registration stayed and the subagent ran later, its result answered after the
    user's stop. The look is tried again."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    from bus_redis import ControlMessage, RedisBus
    from worker import AgentLoop

    spawner = AgentLoop(RedisBus(redis), ScriptedProvider(handler=Model()))
    store = spawner.subagents.store
    await redis.set(K.lease("web:b"), "n|w", px=10_000)
    doc = {"id": "s1", "session": "web:b", "channel": "web", "chat_id": "b", "scope": "web/u",
           "label": "s1", "task": "t", "after": "100-0"}  # fmt: skip
    assert await store.add("web:b", "n|w", "web:b", "s1", json.dumps(doc), limit=3,
                           channel_limit=8, scope="web/u", scope_limit=2) == 1  # fmt: skip
    real, failed = store.of_session, []

    async def of_session(session: str) -> Any:
        if not failed:
            failed.append(session)
            raise RedisConnectionError("Connection reset by peer")
        return await real(session)

    store.of_session = of_session  # type: ignore[method-assign]
    spawner.subagents.aborts.remember("web:b")
    spawner.subagents.on_control(ControlMessage(op="stop", session_key="web:b", marker="200-0"))

    async def unregistered() -> bool:
        return await real("web:b") == {}

    await until(unregistered, timeout_s=10)  # (looked at again a moment later)
    assert failed == ["web:b"]
    await spawner.jobs.aclose()


async def test_an_interrupt_that_drops_the_spawns_tool_round_takes_the_subagent_with_it(  # type: ignore[no-untyped-def]
    redis, make_loop
) -> None:
    """The model spawns and, in the same round, reads another session (held here). An
    interrupt then cuts the turn: the round is incomplete, so its rows are dropped, and
    the subagent it spawned must go too (as a schedule does): the history never names
    it, so its result would answer a call nobody remembers. (An interrupt keeps
    complete exchanges: it is not one of the controls that abort subagents.)"""
    model, reading = Model(), asyncio.Event()
    call = "research slow thing"

    async def handler(**kw: Any) -> LLMResponse:
        last = kw["messages"][-1]
        if last["role"] == "user" and last["content"] == call:
            return LLMResponse(tool_calls=[
                ToolCallRequest("c1", "spawn", {"task": "slow thing", "label": "r"}),
                ToolCallRequest("c2", "read_session", {"session_key": "web:elsewhere"}),
            ])  # fmt: skip
        return await model(**kw)

    loop = make_loop(ScriptedProvider(handler=handler))
    read = loop.rt.sessions.read_session

    async def held_read(*args: Any, **kw: Any) -> Any:
        reading.set()
        await asyncio.Event().wait()  # until the interrupt cancels the turn
        return await read(*args, **kw)

    loop.rt.sessions.read_session = held_read
    client = FrontendClient(redis)
    await client.send(_m("ir", call, "i1"))
    await asyncio.wait_for(reading.wait(), 10)
    await asyncio.wait_for(model.subagent_started.wait(), 10)  # it runs (here)
    await client.send_entry(
        _m("ir", "never mind", "i2").model_copy(update={"followup": "interrupt"})
    )
    got = await collect(client, "web", {"i1", "i2"}, timeout_s=10)
    assert [e.code for e in got["i1"] if e.is_terminal] == ["cancelled"]
    await until(lambda: not loop.subagents.running, timeout_s=10)
    assert model.cancelled == 1  # cancelled where it ran
    assert not await redis.hlen(K.spawned("web:ir"))  # and unregistered
    assert await _spawn_replies(client, "web") == []  # no result comes back


async def test_a_subagent_unregistered_elsewhere_stops_running(  # type: ignore[no-untyped-def]
    redis, make_loop, monkeypatch
) -> None:
    """A cut turn's undo on another worker unregisters the subagent but cannot cancel it:
    it ran on to its end (model calls, tools) although its result is never published.
    It now ends soon after its registration goes."""
    monkeypatch.setattr("worker.jobs.subagents.WATCH_S", 0.05)  # (2 s in a worker)
    model = Model()
    loop = make_loop(ScriptedProvider(handler=model), followup_mode="queue")
    client = FrontendClient(redis)
    await client.send(_m("un", "research slow thing", "q1"))
    await collect(client, "web", {"q1"}, timeout_s=10)
    await asyncio.wait_for(model.subagent_started.wait(), 10)
    [sid] = await redis.hkeys(K.spawned("web:un"))
    assert await loop.subagents.store.drop("web:un", sid)  # as another worker's undo does
    await until(lambda: model.cancelled == 1, timeout_s=10)
    await until(lambda: not loop.subagents.running, timeout_s=10)
    assert await _spawn_replies(client, "web") == []


async def test_only_the_run_a_registration_names_publishes_its_result(redis) -> None:  # type: ignore[no-untyped-def]
    """A claim by a survivor takes the run out of the registration; the survivor's start
    names its own. A stalled worker's run that finishes after that publishes nothing,
    the run named publishes once."""
    from bus_redis import RedisBus
    from bus_redis.subagents import SubagentStore

    store = SubagentStore(RedisBus(redis))
    session = "web:r"
    doc = {"id": "s1", "state": "running", "worker": "w0", "run": "old"}
    await redis.hset(K.spawned(session), "s1", json.dumps(doc))
    assert await store.run_of(session, "s1") == "old"
    assert await store.claim_orphan(session, "s1", "w0", "w1")
    assert await store.run_of(session, "s1") == ""  # claimed: no run until it starts again
    assert await store.running(session, "s1", json.dumps(doc | {"worker": "w1", "run": "new"}))
    payload = _m("r", "result", "spawn:s1").model_dump_json()
    assert not await store.finish(session, "s1", payload, run="old")
    assert not await redis.exists(K.inbound(session))
    assert await store.finish(session, "s1", payload, run="new")
    assert await redis.xlen(K.inbound(session)) == 1
    assert await store.run_of(session, "s1") is None  # done: unregistered
