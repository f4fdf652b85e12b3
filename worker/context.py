"""Prompt assembly. The static system prompt is built once per process; the memory
section is cached by memory version; history comes from the session's bounded replay."""

from __future__ import annotations

from typing import Any

from session_store import Session

IDENTITY = (
    "You are a helpful assistant running inside redis-agent-worker. "
    "Answer the user directly; use tools when they help, and never invent tool results."
)


class ContextBuilder:
    def __init__(
        self, tool_names: list[str], *, identity: str = IDENTITY, history_tokens: int = 16_000
    ) -> None:
        tools = ", ".join(tool_names) or "none"
        self._static = (
            f"{identity}\n\n# Tools\nAvailable tool names: {tools}. Call them with JSON arguments."
        )
        self._with_memory: tuple[str, str] = ("", self._static)
        self.history_tokens = history_tokens

    def system_prompt(self, memory: str | None) -> str:
        if not memory:
            return self._static
        if self._with_memory[0] != memory:
            self._with_memory = (memory, f"{self._static}\n\n# Long-term memory\n{memory}")
        return self._with_memory[1]

    def build(
        self, session: Session, user_row: dict[str, Any], memory: str | None
    ) -> list[dict[str, Any]]:
        """``[system, *history, user]``; ``memory`` is None for transient sessions."""
        history = session.get_history(max_tokens=self.history_tokens)
        current = {"role": "user", "content": user_row["content"]}
        return [{"role": "system", "content": self.system_prompt(memory)}, *history, current]
