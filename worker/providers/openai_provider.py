"""OpenAIProvider: any OpenAI-compatible chat API (OpenAI, vLLM, Ollama, OpenRouter, LiteLLM).

Retries 429, 5xx, timeouts and connection errors with exponential backoff; everything
else fails at once. Cancellation of the awaiting task closes the HTTP request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Callable
from typing import Any

import openai
from openai import AsyncOpenAI

from worker.providers.base import (
    DeltaCallback,
    GenerationSettings,
    LLMResponse,
    ProviderError,
    ToolCallRequest,
)

log = logging.getLogger(__name__)
_RETRYABLE = (
    openai.RateLimitError,
    openai.APITimeoutError,
    openai.APIConnectionError,
    openai.InternalServerError,
)


DEFAULT_BASE_URL = "https://api.openai.com/v1"


class OpenAIProvider:
    def __init__(
        self,
        model: str,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout_s: float = 120.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        generation: GenerationSettings | None = None,
    ) -> None:
        self.model = model
        self.generation = generation or GenerationSettings()
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.on_retry: Callable[[], object] | None = None  # counts retries (worker metrics)
        self.client = AsyncOpenAI(
            # explicit: an empty OPENAI_BASE_URL in the environment would otherwise win
            base_url=base_url or DEFAULT_BASE_URL,
            api_key=api_key or "not-needed",
            timeout=timeout_s,
            max_retries=0,
        )

    def get_default_model(self) -> str:
        return self.model

    async def aclose(self) -> None:
        await self.client.close()

    async def chat_with_retry(
        self,
        *,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        model: str | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        on_delta: DeltaCallback | None = None,
    ) -> LLMResponse:
        kwargs: dict[str, Any] = {
            "model": model or self.model,
            "messages": messages,
            "max_tokens": max_tokens or self.generation.max_tokens,
            "temperature": self.generation.temperature if temperature is None else temperature,
        }
        if tools:
            kwargs["tools"] = tools
        for attempt in range(self.max_retries + 1):
            try:
                if on_delta is not None:
                    return await self._stream(kwargs, on_delta)
                return _parse(await self.client.chat.completions.create(**kwargs))
            except _RETRYABLE as exc:
                if attempt == self.max_retries:
                    raise ProviderError(f"{type(exc).__name__}: {exc}") from exc
                delay = self.backoff_s * 2**attempt * (0.5 + random.random())
                if self.on_retry is not None:
                    self.on_retry()
                log.warning(
                    "provider retry %d in %.2fs: %s", attempt + 1, delay, type(exc).__name__
                )
                await asyncio.sleep(delay)
            except openai.OpenAIError as exc:
                raise ProviderError(f"{type(exc).__name__}: {exc}") from exc
        raise ProviderError("unreachable")

    async def _stream(self, kwargs: dict[str, Any], on_delta: DeltaCallback) -> LLMResponse:
        stream = await self.client.chat.completions.create(**kwargs, stream=True)
        parts: list[str] = []
        calls: dict[int, dict[str, Any]] = {}
        finish = "stop"
        async for chunk in stream:
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            finish = choice.finish_reason or finish
            delta = choice.delta
            if delta.content:
                parts.append(delta.content)
                await on_delta(delta.content)
            for tc in delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                slot["id"] = tc.id or slot["id"]
                if tc.function is not None:
                    slot["name"] += tc.function.name or ""
                    slot["arguments"] += tc.function.arguments or ""
        tool_calls = [
            ToolCallRequest(c["id"], c["name"], _args(c["arguments"])) for c in calls.values()
        ]
        return LLMResponse(content="".join(parts), tool_calls=tool_calls, finish_reason=finish)


def _args(raw: str | None) -> dict[str, Any]:
    try:
        value = json.loads(raw or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _parse(completion: Any) -> LLMResponse:
    choice = completion.choices[0]
    message = choice.message
    calls = [
        ToolCallRequest(tc.id, tc.function.name, _args(tc.function.arguments))
        for tc in (message.tool_calls or [])
        if getattr(tc, "function", None) is not None
    ]
    usage = completion.usage.model_dump() if completion.usage is not None else {}
    return LLMResponse(
        content=message.content,
        tool_calls=calls,
        usage=usage,
        finish_reason=choice.finish_reason or "stop",
    )
