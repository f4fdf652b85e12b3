"""What the chat-completions wire's JSON means: a whole answer (:func:`parse_answer`), a
streamed one assembled from its server-sent lines (:class:`StreamedAnswer`), an error
body's message (:func:`error_message`). No I/O: ``openai_provider`` makes the calls."""

from __future__ import annotations

import json
from typing import Any

from worker.agent.providers.base import DeltaCallback, LLMResponse, ProviderError, ToolCallRequest

# tool calls one answer may make (more: the answer is refused, not run call by call)
MAX_TOOL_CALLS = 128
# of a call's arguments that are not a JSON object, the text kept in its row (the model
# reads it back with the error; it is no use to anyone whole)
MALFORMED_MAX_CHARS = 2_000


class StreamedAnswer:
    """The answer being assembled from server-sent chunks."""

    def __init__(self, on_delta: DeltaCallback) -> None:
        self.on_delta = on_delta
        self.parts: list[str] = []
        self.calls: dict[Any, dict[str, Any]] = {}
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
                index = self._slot(tc)
                if index not in self.calls and len(self.calls) >= MAX_TOOL_CALLS:
                    raise ProviderError(_too_many(len(self.calls) + 1))
                slot = self.calls.setdefault(index, {"id": "", "name": [], "args": []})
                slot["id"] = _text(tc.get("id"), "a tool call's id") or slot["id"]
                function = tc.get("function") or {}
                slot["name"].append(_text(function.get("name"), "a tool call's name"))
                slot["args"].append(_text(function.get("arguments"), "a tool call's arguments"))
        return True

    def _slot(self, piece: dict[str, Any]) -> Any:
        """Which call a streamed piece continues: its ``index``; without one (some servers
        send each call whole), a piece naming a new ``id`` starts a call and any other
        continues the last one."""
        if (index := piece.get("index")) is not None:
            return index
        last = next(reversed(self.calls), None)
        new_id = piece.get("id")
        if last is None or (new_id and self.calls[last]["id"] and new_id != self.calls[last]["id"]):
            return ("unindexed", len(self.calls))
        return last

    def result(self) -> LLMResponse:
        tool_calls = [
            _call(c["id"], "".join(c["name"]), "".join(c["args"])) for c in self.calls.values()
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


def _call(call_id: str, name: str, raw: str) -> ToolCallRequest:
    """A tool call; arguments that are not a JSON object are kept as ``malformed`` text
    (cut to ``MALFORMED_MAX_CHARS``), never replaced by defaults."""
    try:
        value = json.loads(raw or "{}")
    except (ValueError, RecursionError):
        value = None
    if isinstance(value, dict):
        return ToolCallRequest(call_id, name, value)
    return ToolCallRequest(call_id, name, {}, malformed=raw[:MALFORMED_MAX_CHARS])


def _text(value: Any, what: str) -> str:
    """``value`` when it is text (None: empty), else the answer is refused: a number or an
    object where the wire has a string must not reach the turn as something else."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ProviderError(f"APIResponseValidationError: {what} is a {type(value).__name__}")
    return value


def _too_many(n: int) -> str:
    return f"APIResponseValidationError: {n} tool calls in one answer (at most {MAX_TOOL_CALLS})"


def parse_answer(doc: dict[str, Any]) -> LLMResponse:
    choice = doc["choices"][0]
    message = choice.get("message") or {}
    raw_calls = message.get("tool_calls") or ()
    if len(raw_calls) > MAX_TOOL_CALLS:
        raise ProviderError(_too_many(len(raw_calls)))
    calls = [
        _call(
            _text(tc.get("id"), "a tool call's id"),
            _text(function["name"], "a tool call's name"),
            _text(function.get("arguments"), "a tool call's arguments"),
        )
        for tc in raw_calls
        if isinstance(function := tc.get("function"), dict) and function.get("name")
    ]
    content = message.get("content")
    if isinstance(content, list):  # content parts (some servers): their text, joined
        content = "".join(_text(p.get("text"), "a content part") for p in content
                          if isinstance(p, dict) and p.get("type") == "text")  # fmt: skip
    return LLMResponse(
        content=None if content is None else _text(content, "the answer's content"),
        tool_calls=calls,
        usage=doc.get("usage") or {},
        finish_reason=choice.get("finish_reason") or "stop",
    )
