"""The provider interface of the agent turn (as in the reference loop)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

DeltaCallback = Callable[[str], Awaitable[None]]


class ProviderError(Exception):
    """The LLM could not answer (after retries)."""


@dataclass(frozen=True, slots=True)
class ToolCallRequest:
    id: str
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


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
