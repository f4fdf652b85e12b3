"""A transcript that is always valid: every assistant tool call is answered by exactly one
tool result before the next model call, whatever cuts a turn (stop, lease loss, crash,
provider error), over interleavings hypothesis picks. The real TurnRunner runs turns of
tool rounds against one Session; a cut lands at any provider call or tool execution; what
the holder would keep of the cut turn is appended as it would be (``worker.runtime``); a
crash is followed by the redelivered attempt, which replays the lost one's tool journal
and runs no tool call twice."""

from __future__ import annotations

import asyncio
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from session_store import Session
from session_store.models import INTERRUPTED
from worker.agent.prompt import ContextBuilder
from worker.agent.providers import LLMResponse, ProviderError, ToolCallRequest
from worker.agent.runner import TurnRunner, TurnState
from worker.agent.tools import ToolContext, ToolRegistry
from worker.runtime.execution import KEEPS_WORK
from worker.runtime.outcomes import legal_prefix


def assert_valid(messages: list[dict[str, Any]], *, closed: bool) -> None:
    """Each assistant row's calls are answered once, by the tool rows right after it, and no
    tool row answers anything else; ``closed``: none is left waiting at the end."""
    pending: list[str] = []
    for row in messages:
        if row.get("role") == "tool":
            assert row.get("tool_call_id") in pending, f"orphan tool result {row}"
            pending.remove(row["tool_call_id"])
            continue
        assert not pending, f"calls {pending} unanswered before {row.get('role')}"
        if row.get("role") == "assistant" and row.get("tool_calls"):
            pending = [c["id"] for c in row["tool_calls"]]
    if closed:
        assert not pending, f"calls {pending} left unanswered"


class Script:
    """Provider and tool in one: counts steps, cuts at the planned one."""

    def __init__(self) -> None:
        self.generation = None
        self.step = 0
        self.cut_at = -1
        self.kind = "none"
        self.rounds: list[int] = []
        self.turn = 0
        self.runs: dict[str, int] = {}  # tool executions by call (ordinal in its turn)

    def get_default_model(self) -> str:
        return "m"

    def _tick(self, *, provider: bool) -> None:
        self.step += 1
        if self.step == self.cut_at:
            if self.kind == "provider_error" and provider:
                raise ProviderError("scripted")
            if self.kind != "provider_error":
                raise asyncio.CancelledError  # a stop / lease loss / crash lands here

    async def chat_with_retry(self, *, messages: list[dict[str, Any]], **_kw: Any) -> LLMResponse:
        assert_valid([m for m in messages if m.get("role") != "system"], closed=True)
        self._tick(provider=True)
        if self.rounds:
            calls = self.rounds.pop(0)
            return LLMResponse(
                tool_calls=[
                    ToolCallRequest(f"t{self.turn}-s{self.step}-{i}", "work", {})
                    for i in range(calls)
                ]
            )
        return LLMResponse(content="done")

    # the tool
    name = "work"
    description = "does work"
    parameters: dict[str, Any] = {"type": "object", "properties": {}}

    async def execute(self, ctx: ToolContext, **_kw: Any) -> str:
        self._tick(provider=False)
        self.runs[ctx.call_id] = self.runs.get(ctx.call_id, 0) + 1
        return "worked"


class Journal:
    """The tool journal in memory (TurnJournal records to Redis, fenced)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    async def record(self, rows: list[dict[str, Any]]) -> None:
        self.rows += rows


TURN = st.tuples(
    st.lists(st.integers(1, 3), max_size=3),  # calls per tool round
    st.sampled_from(["none", "stop", "interrupt", "lease_lost", "crash", "provider_error"]),
    st.integers(1, 12),  # the step the cut lands on (past the turn's end: no cut)
)


@settings(max_examples=150, deadline=None)
@given(st.lists(TURN, min_size=1, max_size=5))
def test_every_transcript_stays_valid(turns: list[tuple[list[int], str, int]]) -> None:
    asyncio.run(_run(turns))


async def _run(turns: list[tuple[list[int], str, int]]) -> None:
    script = Script()
    tools = ToolRegistry()
    tools.register(script)  # type: ignore[arg-type]
    runner = TurnRunner(script, tools, ContextBuilder(["work"]), "m", max_iterations=5)  # type: ignore[arg-type]
    session = Session(key="web:t", scope="web/u")
    for n, (rounds, kind, cut_at) in enumerate(turns):
        script.turn, script.step, script.rounds = n, 0, list(rounds)
        script.kind, script.cut_at = kind, (cut_at if kind != "none" else -1)
        journal = Journal()
        state = TurnState(journal=journal)
        first = {"role": "user", "content": f"turn {n}", "message_id": f"m{n}"}
        ctx = ToolContext(session=session, sessions=None, emit=_emit, turn_id=f"m{n}")  # type: ignore[arg-type]
        try:
            await runner.run(session, first, None, ctx, state)
        except asyncio.CancelledError:
            if kind in KEEPS_WORK:  # what a stopped or interrupted turn keeps (_outcome)
                session.append_rows(legal_prefix(state.rows))
            if kind == "crash":  # redelivered: the new attempt replays the journal
                script.cut_at = -1
                again = TurnState(journal=journal, replayed=list(journal.rows))
                ctx = ToolContext(session=session, sessions=None, emit=_emit, turn_id=f"m{n}")  # type: ignore[arg-type]
                await runner.run(session, first, None, ctx, again)
                session.append_rows(again.rows)
            # lease lost: nothing of the attempt is committed (its entry runs again later)
        except ProviderError:
            session.append_rows(legal_prefix(state.rows))  # answered provider_error
        else:
            session.append_rows(state.rows)
        assert_valid(session.messages, closed=True)
        assert_valid(session.get_history(), closed=True)
        assert all(n == 1 for n in script.runs.values())  # no tool call ran twice


async def _emit(_text: str) -> None:
    return None


def test_rows_that_would_break_it_are_repaired_on_append() -> None:
    """The session model itself keeps the invariant: a call left unanswered is answered
    ``INTERRUPTED`` before the next row, an orphan or duplicate result is dropped."""
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "x", "arguments": "{}"}},
        {"id": "b", "type": "function", "function": {"name": "y", "arguments": "{}"}},
    ]}  # fmt: skip
    s = Session(key="web:r")
    s.append_rows([
        {"role": "user", "content": "hi"},
        {"role": "tool", "tool_call_id": "zz", "content": "orphan"},
        call,
        {"role": "tool", "tool_call_id": "a", "content": "ok"},
        {"role": "tool", "tool_call_id": "a", "content": "again"},
        {"role": "user", "content": "next"},
    ])  # fmt: skip
    assert [(m["role"], m.get("tool_call_id"), m["content"]) for m in s.messages] == [
        ("user", None, "hi"),
        ("assistant", None, ""),
        ("tool", "a", "ok"),
        ("tool", "b", INTERRUPTED),
        ("user", None, "next"),
    ]
    assert_valid(s.messages, closed=True)
    loaded = Session(key="web:r", messages=[{"role": "user", "content": "q"}, call])
    assert_valid(loaded.get_history(), closed=True)  # a stored open tail is shown closed
