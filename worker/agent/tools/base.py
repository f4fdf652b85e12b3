"""Tool protocol, per-turn context and the registry that filters disabled tools."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from session_store import Session, SessionManager
from worker.agent.tools.arguments import bounded_result, checked_arguments
from worker.runtime.outcomes import TurnAbortedError

log = logging.getLogger(__name__)
Emit = Callable[[str], Awaitable[None]]


def call_sid(call_id: str) -> str:
    """The id of what call ``call_id`` made (a schedule, a subagent): the same in a re-run
    of the turn, which replays the call."""
    return hashlib.sha256(call_id.encode("utf-8", "surrogatepass")).hexdigest()[:12]


@dataclass(frozen=True, slots=True)
class Origin:
    """Where the turn's message came from and what fences its writes: a tool that posts
    back into the session (a subagent's result, a schedule's firing) uses it."""

    member: str  # the session key of the inbound stream the message came from
    channel: str
    chat_id: str
    lease_key: str = ""  # the effective key whose lease this turn runs under
    token: str = ""
    entry_id: str = ""  # the message's entry in the session's stream (a control after it applies)


class Services(Protocol):
    """The background services durable-only tools use (``worker.jobs`` implements them)."""

    async def spawn(self, ctx: ToolContext, task: str, label: str) -> str: ...

    async def schedule(self, ctx: ToolContext, action: str, args: dict[str, Any]) -> str: ...

    def undo_of(
        self, name: str, args: dict[str, Any], origin: Origin, call_id: str
    ) -> Callable[[], Awaitable[Any]] | None:
        """What undoes the outside effect call ``call_id`` of tool ``name`` made, or may
        have made, in the turn of ``origin`` (None: none): a re-run that replays a
        journaled call registers it, as the call itself did; a turn never committed (dead
        lettered, or cancelled before its re-run) runs it."""
        ...


@dataclass(slots=True)
class ToolContext:
    """What a tool may touch during one turn."""

    session: Session
    sessions: SessionManager
    emit: Emit  # send a non-terminal message to the session's frontend
    metadata: dict[str, Any] = field(default_factory=dict)  # the inbound message's metadata
    origin: Origin | None = None
    services: Services | None = None
    # the turn ("<session>|<entry id>": the same in a re-run after a crash) and the call
    # being executed ("<turn>#<ordinal>"): ids derived from it are stable and unique
    turn_id: str = ""  # set from the entry; a turn without one gets a random id at its first call
    call_id: str = ""
    tool_call_id: str = ""  # the model's id of the call being executed
    # the tool round the call being executed belongs to (1: the turn's first assistant row
    # with tool calls; a re-run counts the replayed rounds too)
    round: int = 0
    # (its round, what undoes it): outside effects of calls whose rows a cut turn does not
    # keep (a discard keeps none; a stop or interrupt keeps whole rounds only), so a
    # schedule or subagent it added is not live without being in any history. By round,
    # not by the model's call id: a provider may reuse ids across rounds
    undo: list[tuple[int, Callable[[], Awaitable[Any]]]] = field(default_factory=list)

    @property
    def scope(self) -> str:
        """Session tools and memory never leave this scope."""
        return self.session.scope


class Tool(Protocol):
    """A tool: ``execute(ctx, **arguments)`` returns the text fed back to the model.

    Optional class attributes (read with defaults): ``idempotent`` (False) — running the
    call again is harmless: it only reads, or its effect lands with the turn's commit (a
    turn re-run after a crash runs it again; a call of a tool that is not idempotent is
    replayed from the journal instead, never run twice); ``durable_only`` (False) — never
    offered to, nor run in, a session that does not persist (a private session's text
    must not leave its owner's memory, and the tool's effect would outlive it)."""

    name: str
    description: str
    parameters: dict[str, Any]

    @property
    def execute(self) -> Callable[..., Awaitable[str]]: ...


def schema(properties: dict[str, Any], required: Iterable[str] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required)}


class ToolRegistry:
    def __init__(self, tools: Iterable[Tool] = ()) -> None:
        self._tools: dict[str, Tool] = {}
        self._definitions: dict[frozenset[str], list[dict[str, Any]]] = {}
        self._durable: frozenset[str] = frozenset()
        for tool in tools:
            self.register(tool)

    def register(self, tool: Tool) -> None:
        self._tools[tool.name] = tool
        self._definitions.clear()
        self._durable = frozenset(
            n for n, t in self._tools.items() if getattr(t, "durable_only", False)
        )

    @property
    def names(self) -> list[str]:
        return list(self._tools)

    def chosen(self, allow: Iterable[str] = (), deny: Iterable[str] = ()) -> ToolRegistry:
        """The tools an operator chose (``AGENT_TOOLS_ALLOW`` / ``AGENT_TOOLS_DENY``): only
        ``allow`` when given, never ``deny``. A name no tool has is refused, so a typo
        cannot silently leave a tool on."""
        allow, deny = list(allow), list(deny)
        unknown = sorted(set(allow + deny) - set(self._tools))
        if unknown:
            raise ValueError(
                f"unknown tool {unknown[0]!r} in AGENT_TOOLS_ALLOW/AGENT_TOOLS_DENY "
                f"(tools: {', '.join(self._tools)})"
            )
        names = [n for n in self._tools if (not allow or n in allow) and n not in deny]
        return ToolRegistry(self._tools[n] for n in names)

    def undo_of(
        self, name: str, args: dict[str, Any], ctx: ToolContext
    ) -> Callable[[], Awaitable[Any]] | None:
        """What undoes the effect of call ``ctx.call_id`` (``Services.undo_of``)."""
        if ctx.services is None or ctx.origin is None:
            return None
        return ctx.services.undo_of(name, args, ctx.origin, ctx.call_id)

    def is_idempotent(self, name: str) -> bool:
        return bool(getattr(self._tools.get(name), "idempotent", False))

    def unavailable(self, session: Session) -> frozenset[str]:
        """The tools ``session`` may not use: its ``disabled_tools``, and the durable-only
        tools when it does not persist."""
        off = session.policy.disabled_tools
        if session.policy.persist or not self._durable:
            return off
        return off | self._durable

    def definitions(self, disabled: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
        """OpenAI ``tools`` entries of the tools this session may use (built once per
        set of disabled tools; a provider must not change them)."""
        cached = self._definitions.get(disabled)
        if cached is None:
            if len(self._definitions) >= 64:  # sessions' disabled sets are few; stay bounded
                self._definitions.clear()
            cached = self._definitions[disabled] = self._build(disabled)
        return cached

    def _build(self, disabled: frozenset[str]) -> list[dict[str, Any]]:
        return [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.parameters,
                },
            }
            for t in self._tools.values()
            if t.name not in disabled
        ]

    async def execute(self, name: str, arguments: dict[str, Any] | None, ctx: ToolContext) -> str:
        """Run one call; a disabled, unknown or failing tool, arguments that are not a JSON
        object (None) or that its schema does not allow, become an error string the model
        can read, never an exception out of the turn. A result is cut to
        ``RESULT_MAX_CHARS`` (``tools.arguments``)."""
        tool = self._tools.get(name)
        if tool is None or name in self.unavailable(ctx.session):
            return f"Error: tool {name!r} is not available in this session"
        if arguments is None:
            return f"Error: bad arguments for {name}: not a JSON object; the tool did not run"
        args, why = checked_arguments(tool.parameters, arguments)
        if why:
            return f"Error: bad arguments for {name}: {why}"
        try:
            return bounded_result(await tool.execute(ctx, **args))
        except TypeError as exc:
            return f"Error: bad arguments for {name}: {exc}"
        except TurnAbortedError:
            raise  # (its fenced write found the lease lost: the turn ends, nothing written)
        except Exception as exc:
            if ctx.session.policy.log_content:
                log.exception("tool %s failed", name)
            else:
                log.error("tool %s failed: %s", name, type(exc).__name__)
            return f"Error: {name} failed: {type(exc).__name__}"


def as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
