"""EchoProvider: offline and deterministic, for the demo, the docs and tests.

It answers ``echo: <last user text>``. A user text of the form ``/tool NAME {json}``
makes it call that tool (when offered) and then report the tool's result, so the tool
loop can be exercised without a model.
"""

from __future__ import annotations

import json
from typing import Any

from worker.agent.providers.base import (
    DeltaCallback,
    GenerationSettings,
    LLMResponse,
    ToolCallRequest,
)


class EchoProvider:
    def __init__(self, model: str = "echo-1") -> None:
        self.model = model
        self.generation = GenerationSettings()

    def get_default_model(self) -> str:
        return self.model

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
        last = messages[-1] if messages else {}
        if last.get("role") == "tool":
            text = f"tool {last.get('name')} returned: {last.get('content')}"
        else:
            user: dict[str, Any] = next(
                (m for m in reversed(messages) if m.get("role") == "user"), {}
            )
            text = str(user.get("content", ""))
            call = self._tool_call(text, tools or [])
            if call is not None:
                return LLMResponse(content="", tool_calls=[call], finish_reason="tool_calls")
            earlier = max(
                0, len(messages) - 2
            )  # history between the system prompt and the question
            text = f"echo: {text}" + (
                f" (I remember {earlier} earlier messages)" if earlier else ""
            )
        if on_delta is not None:
            await on_delta(text)
        return LLMResponse(content=text, usage={"prompt_tokens": 0, "completion_tokens": 0})

    @staticmethod
    def _tool_call(text: str, tools: list[dict[str, Any]]) -> ToolCallRequest | None:
        if not text.startswith("/tool "):
            return None
        name, _, raw = text[len("/tool ") :].partition(" ")
        offered = {t["function"]["name"] for t in tools}
        if name not in offered:
            return None
        try:
            args = json.loads(raw) if raw.strip() else {}
        except ValueError:
            args = {}
        return ToolCallRequest(
            id=f"call_{name}", name=name, arguments=args if isinstance(args, dict) else {}
        )
