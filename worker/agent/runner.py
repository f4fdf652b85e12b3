"""One agent turn: the LLM / tool loop. Pure of Redis: it reads a Session and returns
the rows to append; the caller commits them under the session lease."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol

from session_store import Session
from session_store.models import now_iso
from worker.agent.prompt import ContextBuilder
from worker.agent.providers import LLMProvider, ToolCallRequest
from worker.agent.providers.base import DeltaCallback
from worker.agent.tools import ToolContext, ToolRegistry
from worker.runtime.faults import crash_point, stall_point

MAX_ITERATIONS_TEXT = "I stopped after reaching the tool-iteration limit for this turn."
MAX_INJECTION_CYCLES = 5
FINAL_DRAIN_MAX = 32  # rows joined at the last model boundary (the rest get their own turn)
UNKNOWN_EFFECT = (
    "Error: the worker running this call stopped before its result was recorded. It was "
    "not run again, so whether it took effect is unknown; tell the user."
)


class ToolJournal(Protocol):
    """Where a turn records its tool exchanges as they happen (fenced by the lease), so
    that a re-run after a crash replays them instead of running the tools again."""

    async def record(self, rows: list[dict[str, Any]]) -> None: ...


class FollowUps(Protocol):
    """Messages of the session that arrived while its turn runs (user rows)."""

    async def __call__(self) -> list[dict[str, Any]]:
        """Read what arrived (at most a few rows a call; [] when nothing joins)."""

    def deferred(self) -> bool:
        """At the last model boundary: whether whoever commits the answer checks what
        arrived instead (``TurnState.rounds``), so that the stream is not read in a round
        trip of its own when nothing did."""


@dataclass(slots=True)
class TurnState:
    """Rows produced so far; read by the caller when the turn is stopped midway."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    final: str | None = None
    tokens_in: int = 0  # as the provider reported them, over the turn's model calls
    tokens_out: int = 0
    journal: ToolJournal | None = None
    replayed: list[dict[str, Any]] = field(default_factory=list)  # the lost attempt's journal
    unknown: list[str] = field(default_factory=list)  # tools whose effect a crash left unknown
    calls: int = 0  # tool calls executed (or replayed) so far: a call's ordinal
    # whether the turn may still act (its lease holds: ``Lease.holds``), looked at before
    # each model call and each tool call; None: always
    held: Callable[[], bool] | None = None
    # set when the turn ended at its last model boundary with ``final`` and left what
    # arrived meanwhile to whoever commits it (``FollowUps.deferred``): where its loop
    # stands, for ``TurnRunner.go_on`` (nothing in it refers back to this state: no
    # reference cycle a turn would leave to the garbage collector)
    rounds: _Rounds | None = None


@dataclass(slots=True)
class _Rounds:
    """Where a turn's loop stands (so that it can go on after it returned)."""

    messages: list[dict[str, Any]]
    offered: list[dict[str, Any]]
    ctx: ToolContext
    followups: FollowUps | None
    on_delta: DeltaCallback | None
    injections: int = 0
    done: int = 0  # model calls made


def _call_row(content: str | None, calls: list[ToolCallRequest]) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": content or "",
        "timestamp": now_iso(),
        "tool_calls": [
            {
                "id": c.id,
                "type": "function",
                "function": {
                    "name": c.name,
                    "arguments": json.dumps(c.arguments) if c.malformed is None else c.malformed,
                },
            }
            for c in calls
        ],
    }


def _exchanges(
    journal: list[dict[str, Any]],
) -> list[tuple[dict[str, Any], dict[Any, dict[str, Any]]]]:
    """Each journaled assistant row with tool calls, and the results recorded after it
    (before the next such row) by call id: a provider that reuses call ids across rounds
    gets each round's own results (the last recorded wins within a round)."""
    out: list[tuple[dict[str, Any], dict[Any, dict[str, Any]]]] = []
    for row in journal:
        if row.get("role") == "assistant" and row.get("tool_calls"):
            out.append((row, {}))
        elif row.get("role") == "tool" and out:
            out[-1][1][row.get("tool_call_id")] = row
    return out


def journaled_calls(journal: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """Each journaled call's tool name and arguments (``{}`` when they are no JSON
    object), in the order a re-run counts them (``_enter``: its ``n``-th is call ``n``)."""
    return [
        (str((call.get("function") or {}).get("name")),
         _arguments(call.get("function") or {}) or {})
        for row, _ in _exchanges(journal)
        for call in row["tool_calls"]
    ]  # fmt: skip


def _enter(state: TurnState, ctx: ToolContext, tool_call_id: str) -> None:
    """Count the next call of the turn and name it in ``ctx`` (its round, its id: the same
    call in a re-run gets the same id)."""
    state.calls += 1
    ctx.tool_call_id = tool_call_id
    ctx.round = sum(1 for r in state.rows if r.get("role") == "assistant" and r.get("tool_calls"))
    if not ctx.turn_id:
        ctx.turn_id = uuid.uuid4().hex
    ctx.call_id = f"{ctx.turn_id}#{state.calls}"


async def _record(state: TurnState, rows: list[dict[str, Any]]) -> None:
    if state.journal is not None:
        await state.journal.record(rows)


def _arguments(fn: dict[str, Any]) -> dict[str, Any] | None:
    """A journaled call's arguments; None when they are not a JSON object (as stored by
    ``_call_row`` for a malformed call: it is answered with an error again)."""
    try:
        args = json.loads(fn.get("arguments") or "{}")
    except (ValueError, RecursionError):
        return None
    return args if isinstance(args, dict) else None


def _still_held(state: TurnState) -> None:
    """The turn's lease ran out (its worker stalled past it): no model call or tool call
    is made for a session another worker may be serving now. The lease is marked lost,
    which cancels the turn; this ends it before the call."""
    if state.held is not None and not state.held():
        raise asyncio.CancelledError


async def _drain(followups: FollowUps) -> list[dict[str, Any]]:
    """Everything pending that can join (at most FINAL_DRAIN_MAX rows)."""
    rows: list[dict[str, Any]] = []
    while len(rows) < FINAL_DRAIN_MAX:
        more = await followups()
        if not more:
            break
        rows += more
    return rows


@dataclass(slots=True)
class TurnRunner:
    provider: LLMProvider
    tools: ToolRegistry
    context: ContextBuilder
    model: str
    max_iterations: int = 20

    async def run(
        self,
        session: Session,
        first_row: dict[str, Any],
        memory: str | None,
        ctx: ToolContext,
        state: TurnState,
        followups: FollowUps | None = None,
        on_delta: DeltaCallback | None = None,
        *,
        retry: bool = False,
    ) -> str:
        """The tool loop. After each round of tool results, messages of the same session
        that arrived meanwhile (``followups``) are injected as user rows. ``retry``: the
        session already ends with ``first_row`` (its turn failed at the provider), so it is
        answered without being added again."""
        if not retry:
            state.rows.append(first_row)
        off = self.tools.unavailable(session)
        messages = self.context.build(session, None if retry else first_row, memory, off)
        offered = self.tools.definitions(off)
        if state.replayed:
            await self._resume(state, messages, ctx)
        return await self._rounds(state, _Rounds(messages, offered, ctx, followups, on_delta))

    async def _rounds(self, state: TurnState, at: _Rounds) -> str:
        messages, followups = at.messages, at.followups
        while at.done < self.max_iterations:
            at.done += 1
            stall_point("before_model")
            _still_held(state)
            response = await self.provider.chat_with_retry(
                messages=messages, tools=at.offered or None, model=self.model, on_delta=at.on_delta
            )
            usage = response.usage or {}
            state.tokens_in += int(usage.get("prompt_tokens") or 0)
            state.tokens_out += int(usage.get("completion_tokens") or 0)
            if not response.tool_calls:
                # the last model boundary: messages that arrived meanwhile join before the
                # answer is final (the whole pending prefix, in order, a row each); the
                # model answers again with them in view, the answer so far kept as a row
                text = self._finish(state, response.content or "")
                if followups is None or at.injections >= MAX_INJECTION_CYCLES:
                    return text
                if at.done >= self.max_iterations:  # no model call left to answer them:
                    return text  # this answer stands; what arrived gets its own turn
                at.injections += 1
                if followups.deferred():
                    state.rounds = at
                    return text
                if not await self._join_late(state, at):
                    return text
                continue
            call_row = _call_row(response.content, response.tool_calls)
            messages.append({k: v for k, v in call_row.items() if k != "timestamp"})
            state.rows.append(call_row)
            await _record(state, [call_row])  # before any call runs
            for call in response.tool_calls:
                arguments = call.arguments if call.malformed is None else None
                result = await self._execute(state, call.name, arguments, at.ctx, call.id)
                crash_point("tool_ran")
                await self._answer(state, messages, call.id, call.name, result)
                crash_point("tool_recorded")
            if followups is not None and at.injections < MAX_INJECTION_CYCLES:
                at.injections += 1
                for row in await followups():
                    messages.append({"role": "user", "content": row["content"]})
                    state.rows.append(row)
        return self._finish(state, MAX_ITERATIONS_TEXT)

    async def _join_late(self, state: TurnState, at: _Rounds) -> bool:
        """Whether messages joined after the answer so far (the model answers again, the
        answer kept as a row)."""
        return await self._read_late(state, at, *self._hold(state))

    @staticmethod
    def _hold(state: TurnState) -> tuple[str, dict[str, Any]]:
        """Until what arrived is read, the answer so far is no answer: a stop meanwhile
        keeps none that the user never got."""
        assert state.final is not None
        text, answer = state.final, state.rows.pop()
        state.final = None
        return text, answer

    async def _read_late(
        self, state: TurnState, at: _Rounds, text: str, answer: dict[str, Any]
    ) -> bool:
        assert at.followups is not None
        late = await _drain(at.followups)
        state.rows.append(answer)
        if not late:
            state.final = text
            return False
        at.messages.append({"role": "assistant", "content": text})
        for row in late:
            at.messages.append({"role": "user", "content": row["content"]})
            state.rows.append(row)
        return True

    def go_on(self, state: TurnState) -> Coroutine[Any, Any, str]:
        """A turn that ended at its last model boundary (``TurnState.rounds``) reads what
        arrived and goes on with what joins (the answer so far kept as a row), or ends
        with the answer it had. Its answer is held back at once (``_hold``)."""
        at, state.rounds = state.rounds, None
        assert at is not None
        return self._go_on(state, at, *self._hold(state))

    async def _go_on(self, state: TurnState, at: _Rounds, text: str, answer: dict[str, Any]) -> str:
        if not await self._read_late(state, at, text, answer):
            return text
        return await self._rounds(state, at)

    async def _execute(
        self,
        state: TurnState,
        name: str,
        arguments: dict[str, Any] | None,
        ctx: ToolContext,
        tool_call_id: str = "",
    ) -> str:
        _enter(state, ctx, tool_call_id)
        _still_held(state)
        return await self.tools.execute(name, arguments, ctx)

    @staticmethod
    async def _answer(
        state: TurnState,
        messages: list[dict[str, Any]],
        call_id: str,
        name: str,
        result: str,
        *,
        record: bool = True,
        unknown: bool = False,
    ) -> None:
        row = {"role": "tool", "tool_call_id": call_id, "name": name, "content": result}
        messages.append(row)
        row = {**row, "timestamp": now_iso()}
        state.rows.append(row)
        if record:  # the journal remembers a synthetic result as one (a later re-run says so)
            await _record(state, [{**row, "unknown": True} if unknown else row])

    async def _resume(
        self, state: TurnState, messages: list[dict[str, Any]], ctx: ToolContext
    ) -> None:
        """A re-run after a crash: the lost attempt's tool exchanges come first, from its
        journal. A call of an idempotent tool runs again (its effect may have been lost
        with the attempt's uncommitted session); any other call is never run twice: its
        journaled result is used. Calls run one after another, so of a row's calls only
        the first without a recorded result can have been running when the worker died:
        its effect is unknown (a result says so, recorded as such, and the reply says
        so); the calls after it never started and run now."""
        for row, results in _exchanges(state.replayed):
            messages.append({k: v for k, v in row.items() if k != "timestamp"})
            state.rows.append(row)
            cut = False  # passed the call that was running when the worker died
            for call in row["tool_calls"]:
                call_id, fn = call.get("id"), call.get("function") or {}
                name, journaled = str(fn.get("name")), results.get(call_id)
                running = journaled is None and not cut  # it may have run, or not
                cut = cut or journaled is None
                if self.tools.is_idempotent(name) or (journaled is None and not running):
                    result = await self._execute(state, name, _arguments(fn), ctx, str(call_id))
                    await self._answer(state, messages, call_id, name, result)
                    continue
                _enter(state, ctx, str(call_id))  # what it did is this turn's to undo
                undo = self.tools.undo_of(name, _arguments(fn) or {}, ctx)  # when cut
                if undo is not None:
                    ctx.undo.append((ctx.round, undo))
                if journaled is not None:
                    if journaled.get("unknown"):
                        state.unknown.append(name)
                    content = str(journaled.get("content"))
                    await self._answer(state, messages, call_id, name, content, record=False)
                    continue
                state.unknown.append(name)
                await self._answer(state, messages, call_id, name, UNKNOWN_EFFECT, unknown=True)

    @staticmethod
    def _finish(state: TurnState, text: str) -> str:
        state.rows.append({"role": "assistant", "content": text, "timestamp": now_iso()})
        state.final = text
        return text
