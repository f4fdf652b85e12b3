"""Tool effects at most once when a turn is re-run after a crash: the journal of the lost
attempt (fenced by its lease) is replayed into the new one; a call of a tool that is not
idempotent never runs twice, and when the crash came between its run and its record the
user is told its effect is unknown. Scripts on fakeredis and a real redis-server; the
kill -9 on real processes."""

from __future__ import annotations

import json
from typing import Any

import pytest
import redis.asyncio as aioredis
from replies import collect, until
from test_transcript import assert_valid

from bus_redis import FrontendClient, InboundMessage, Keys, RedisBus
from session_store import Session
from session_store.models import now_iso
from worker.agent.prompt import ContextBuilder
from worker.agent.providers import LLMResponse
from worker.agent.runner import UNKNOWN_EFFECT, TurnRunner, TurnState
from worker.agent.tools import ToolContext, ToolRegistry
from worker.agent.tools.base import schema
from worker.runtime.journal import TurnJournal
from worker.runtime.outcomes import TurnAbortedError

K = "web:j"


def _held() -> bool:
    return True


async def test_the_journal_is_fenced_and_holds_one_entry(redis: aioredis.Redis) -> None:
    bus = RedisBus(redis)
    await redis.set(bus.keys.lease(K), "n1|w", px=10_000)
    first = TurnJournal(bus, K, "n1|w", K, "1-1", _held)
    await first.record([{"role": "assistant", "tool_calls": [{"id": "c"}]}])
    await first.record([{"role": "tool", "tool_call_id": "c", "content": "done"}])
    assert [r["role"] for r in await first.replay()] == ["assistant", "tool"]
    assert await TurnJournal(bus, K, "n1|w", K, "2-1", _held).replay() == []  # another entry's
    # a zombie whose lease was taken over writes nothing, and its turn ends
    zombie = TurnJournal(bus, K, "n0|old", K, "1-1", _held)
    with pytest.raises(TurnAbortedError):
        await zombie.record([{"role": "tool", "tool_call_id": "c", "content": "late"}])
    assert len(await first.replay()) == 2
    # the next entry under the lease starts afresh (the lost one was dead-lettered)
    second = TurnJournal(bus, K, "n1|w", K, "2-1", _held)
    await second.record([{"role": "assistant", "tool_calls": []}])
    assert await first.replay() == []
    await second.drop()
    assert await redis.exists(bus.keys.journal(K)) == 0


class Effect:
    """A tool with an outside effect (not idempotent): counts its runs."""

    description = "has an effect"
    parameters = schema({})
    idempotent = False

    def __init__(self, name: str) -> None:
        self.name = name
        self.runs = 0

    async def execute(self, ctx: ToolContext) -> str:
        self.runs += 1
        return f"{self.name} ran"


class Read(Effect):
    idempotent = True


class Script:
    """A provider that answers at once, recording what it was asked."""

    generation = None

    def __init__(self) -> None:
        self.asked: list[list[dict[str, Any]]] = []

    def get_default_model(self) -> str:
        return "m"

    async def chat_with_retry(self, *, messages: list[dict[str, Any]], **_: Any) -> LLMResponse:
        self.asked.append(list(messages))
        return LLMResponse(content="final")


def _call(call_id: str, name: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": "{}"}}


async def test_a_rerun_replays_the_journal_and_runs_no_effect_twice() -> None:
    sent, pending, read = Effect("send"), Effect("charge"), Read("lookup")
    tools = ToolRegistry([sent, pending, read])
    provider = Script()
    runner = TurnRunner(provider, tools, ContextBuilder(tools.names), "m")  # type: ignore[arg-type]
    session = Session("web:j")
    calls = [_call("c1", "send"), _call("c2", "lookup"), _call("c3", "charge")]
    state = TurnState(
        replayed=[
            {"role": "assistant", "content": "", "tool_calls": calls, "timestamp": now_iso()},
            {"role": "tool", "tool_call_id": "c1", "name": "send", "content": "sent #1"},
            {"role": "tool", "tool_call_id": "c2", "name": "lookup", "content": "old"},
            # the crash came after `charge` started: no result recorded
        ]
    )
    first = {"role": "user", "content": "go", "timestamp": now_iso(), "message_id": "m"}
    ctx = ToolContext(session, None, emit=None)  # type: ignore[arg-type]
    await runner.run(session, first, None, ctx, state)
    assert (sent.runs, pending.runs, read.runs) == (0, 0, 1)
    assert state.unknown == ["charge"]
    results = {r["tool_call_id"]: r["content"] for r in state.rows if r.get("role") == "tool"}
    assert results == {"c1": "sent #1", "c2": "lookup ran", "c3": UNKNOWN_EFFECT}
    assert [m["role"] for m in provider.asked[0][-5:]] == [
        "user",
        "assistant",
        "tool",
        "tool",
        "tool",
    ]
    session.append_rows(state.rows)
    assert_valid(session.messages, closed=True)


async def test_only_the_call_running_at_the_crash_is_unknown_and_a_second_crash_keeps_it() -> None:
    """Calls of one row run one after another: of those without a recorded result only
    the first may have run (its effect is unknown); the later ones never started and run
    now. The unknown result is journaled as such, so a re-run after a second crash still
    says so."""
    first, second = Effect("send"), Effect("charge")
    tools = ToolRegistry([first, second])
    runner = TurnRunner(Script(), tools, ContextBuilder(tools.names), "m")  # type: ignore[arg-type]
    calls = [_call("c1", "send"), _call("c2", "charge")]
    lost = [{"role": "assistant", "content": "", "tool_calls": calls, "timestamp": now_iso()}]
    journal = Recorder()
    state = TurnState(replayed=lost, journal=journal)
    user = {"role": "user", "content": "go", "timestamp": now_iso(), "message_id": "m"}
    session = Session("web:j2")
    ctx = ToolContext(session, None, emit=None)  # type: ignore[arg-type]
    await runner.run(session, user, None, ctx, state)
    assert (first.runs, second.runs) == (0, 1)
    assert state.unknown == ["send"]
    # the second crash: the journal now holds the first attempt's row and the new results
    again = TurnState(replayed=lost + journal.rows)
    await runner.run(Session("web:j2"), user, None, ctx, again)
    assert (first.runs, second.runs) == (0, 1)  # nothing ran again
    assert again.unknown == ["send"]


class Recorder:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    async def record(self, rows: list[dict[str, Any]]) -> None:
        self.rows += rows


# --- kill -9 between a tool's run and the commit (real processes) ---------------------------


def _tool_text(tag: str) -> str:
    return f'[{tag}] toolcall:message{{"content": "effect {tag}"}} now'


async def _effects(redis: aioredis.Redis, key: str, tag: str) -> int:
    """How many times the message tool's effect (a progress event) reached the user."""
    rows = await redis.xrange(Keys().out(key))
    docs = [json.loads(fields["payload"]) for _, fields in rows]
    return sum(d.get("type") == "progress" and d.get("content") == f"effect {tag}" for d in docs)


@pytest.mark.real_redis
@pytest.mark.slow
@pytest.mark.parametrize("point", ["tool_recorded", "tool_ran"])
async def test_kill_between_a_tool_and_the_commit_runs_the_effect_once(
    real_redis, spawn_workers, point: str
) -> None:  # type: ignore[no-untyped-def]
    """The worker dies (kill -9 at a fault point) after the tool ran; another worker takes
    the session over and re-runs the turn: the effect happened once, the stored transcript
    is valid, and when the crash came before the result was recorded the answer says that
    the effect is unknown."""
    [doomed] = spawn_workers(1, env={"AGENT_FAULT_POINTS": point})
    client = FrontendClient(real_redis)
    chat = f"kill-{point}"
    msg = InboundMessage(
        id="m1", channel="web", chat_id=chat, sender_id="u", content=_tool_text(point)
    )
    await client.send(msg)
    assert doomed.proc.wait(timeout=30) == 137  # died at the point, as under kill -9
    spawn_workers(1)
    got = await collect(client, "web", {"m1"}, timeout_s=30)
    [answer] = [ev for ev in got["m1"] if ev.is_terminal]
    assert answer.type == "message"
    key = f"web:{chat}"
    assert await _effects(real_redis, key, point) == 1
    stored = await _stored(real_redis, key)
    assert_valid(stored, closed=True)
    assert [r["role"] for r in stored] == ["user", "assistant", "tool", "assistant"]
    if point == "tool_ran":
        assert answer.metadata["resumed"] == {"unknown_effects": ["message"]}
        assert "message" in answer.content
        assert "unknown" in answer.content
        assert stored[2]["content"] == UNKNOWN_EFFECT
    else:
        assert "resumed" not in answer.metadata
        assert stored[2]["content"] == "sent"
    # dropped after the commit (which the answer may be seen before)
    await until(lambda: _gone(real_redis, Keys().journal(key)), timeout_s=10)


async def _gone(redis: aioredis.Redis, key: str) -> bool:
    return await redis.exists(key) == 0


async def _stored(redis: aioredis.Redis, key: str) -> list[dict[str, Any]]:
    from session_store import RedisSessionStore

    session = await RedisSessionStore(redis, Keys()).load(key)
    assert session is not None
    return session.messages


async def test_a_provider_reusing_call_ids_gets_each_rounds_own_results() -> None:
    """Round 1 called `send` as call_0 (its result recorded); round 2 called `charge` as
    call_0 again and the worker died during it: charge's effect is unknown, not "sent"."""
    send, charge = Effect("send"), Effect("charge")
    tools = ToolRegistry([send, charge])
    runner = TurnRunner(Script(), tools, ContextBuilder(tools.names), "m")  # type: ignore[arg-type]
    lost = [
        {"role": "assistant", "content": "", "tool_calls": [_call("call_0", "send")]},
        {"role": "tool", "tool_call_id": "call_0", "name": "send", "content": "sent #1"},
        {"role": "assistant", "content": "", "tool_calls": [_call("call_0", "charge")]},
    ]
    state = TurnState(replayed=lost)
    user = {"role": "user", "content": "go", "timestamp": now_iso(), "message_id": "m"}
    session = Session("web:j3")
    await runner.run(session, user, None, ToolContext(session, None, emit=None), state)  # type: ignore[arg-type]
    assert (send.runs, charge.runs) == (0, 0)
    assert state.unknown == ["charge"]
