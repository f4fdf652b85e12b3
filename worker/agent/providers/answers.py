"""What the chat-completions wire's JSON means: a whole answer (:func:`parse_answer`), a
streamed one assembled from its server-sent lines (:class:`StreamedAnswer`), an error
body's message (:func:`error_message`). No I/O: ``openai_provider`` makes the calls."""

from __future__ import annotations

import json
from typing import Any

from worker.agent.providers.base import DeltaCallback, LLMResponse, ProviderError, ToolCallRequest


class StreamedAnswer:
    """The answer being assembled from server-sent chunks."""

    def __init__(self, on_delta: DeltaCallback) -> None:
        self.on_delta = on_delta
        self.parts: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.finish = ""
        self.usage: dict[str, Any] = {}
        self.done = False
        self.started = False  # a delta reached on_delta

    @property
    def complete(self) -> bool:
        return self.done or bool(self.finish)

    async def line(self, line: str) -> bool:
        """Take one SSE line; False at ``[DONE]``."""
        if not line.startswith("data:"):
            return True
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return False
        chunk = json.loads(data)
        if chunk.get("error"):
            raise ProviderError(f"APIError: {error_message(chunk)}")
        self.usage = chunk.get("usage") or self.usage
        for choice in chunk.get("choices") or ():
            self.finish = choice.get("finish_reason") or self.finish
            delta = choice.get("delta") or {}
            if delta.get("content"):
                self.parts.append(delta["content"])
                self.started = True
                await self.on_delta(delta["content"])
            for tc in delta.get("tool_calls") or ():
                # pieces kept in lists, joined once: appending to a string held in a dict
                # copies it every time (quadratic in a call's arguments)
                slot = self.calls.setdefault(tc.get("index", 0), {"id": "", "name": [], "args": []})
                slot["id"] = tc.get("id") or slot["id"]
                function = tc.get("function") or {}
                slot["name"].append(function.get("name") or "")
                slot["args"].append(function.get("arguments") or "")
        return True

    def result(self) -> LLMResponse:
        tool_calls = [
            ToolCallRequest(c["id"], "".join(c["name"]), _tool_args("".join(c["args"])))
            for c in self.calls.values()
        ]
        return LLMResponse(
            content="".join(self.parts),
            tool_calls=tool_calls,
            usage=self.usage,
            finish_reason=self.finish or "stop",
        )


def error_message(doc: Any) -> str:
    if isinstance(doc, dict):
        error = doc.get("error", doc)
        if isinstance(error, dict):
            return str(error.get("message") or error)[:500]
        return str(error)[:500]
    return str(doc)[:500]


def _tool_args(raw: str | None) -> dict[str, Any]:
    try:
        value = json.loads(raw or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def parse_answer(doc: dict[str, Any]) -> LLMResponse:
    choice = doc["choices"][0]
    message = choice.get("message") or {}
    calls = [
        ToolCallRequest(tc.get("id") or "", function["name"], _tool_args(function.get("arguments")))
        for tc in (message.get("tool_calls") or ())
        if isinstance(function := tc.get("function"), dict) and function.get("name")
    ]
    return LLMResponse(
        content=message.get("content"),
        tool_calls=calls,
        usage=doc.get("usage") or {},
        finish_reason=choice.get("finish_reason") or "stop",
    )
