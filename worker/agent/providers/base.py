"""The provider interface of the agent turn (as in the reference loop)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol

DeltaCallback = Callable[[str], Awaitable[None]]


class ProviderError(Exception):
    """The LLM could not answer (after retries)."""


@dataclass(frozen=True, slots=True)
class ToolCallRequest:
    """One call the model asked for. ``malformed`` is the arguments' text when it is not a
    JSON object (the call is then answered with an error, never run with defaults)."""

    id: str
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    malformed: str | None = None


@dataclass(slots=True)
class LLMResponse:
    content: str | None = None
    tool_calls: list[ToolCallRequest] = field(default_factory=list)
    usage: dict[str, Any] = field(default_factory=dict)
    finish_reason: str = "stop"

    @property
    def has_tool_calls(self) -> bool:
        return bool(self.tool_calls)


@dataclass(frozen=True, slots=True)
class GenerationSettings:
    temperature: float = 0.7
    max_tokens: int = 4096


class LLMProvider(Protocol):
    generation: GenerationSettings

    def get_default_model(self) -> str: ...

    async def chat_with_retry(
        self,
        *,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        model: str | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        on_delta: DeltaCallback | None = None,
    ) -> LLMResponse: ...


async def left_when_cancelled(call: Coroutine[Any, Any, LLMResponse]) -> LLMResponse:
    """``call`` in a task of its own: when the turn is cancelled (a stop), it ends at once
    and the request it leaves is closed in the background. The connection pool's clean-up
    takes event-loop iterations of its own, each milliseconds long on a busy worker, that a
    stop's ``cancelled`` answer need not wait for (see docs/PERFORMANCE.md). For a
    provider's network call."""
    task = asyncio.ensure_future(call)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        task.cancel()
        _LEFT.add(task)  # kept until it ends (the loop holds its tasks weakly)
        task.add_done_callback(_retrieved)
        raise


_LEFT: set[asyncio.Task[Any]] = set()


def _retrieved(task: asyncio.Task[Any]) -> None:
    """A left request's end is read, so that a failure of its clean-up is not reported
    as never retrieved (it has no one to reach: the turn has ended)."""
    _LEFT.discard(task)
    if not task.cancelled():
        task.exception()
