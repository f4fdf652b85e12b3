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
        self._identity = identity
        self._tool_names = list(tool_names)
        self._known = frozenset(tool_names)  # the cache below: at most 2**len(tools) prompts
        self._static: dict[frozenset[str], str] = {}  # by disabled tools: never named
        self._with_memory: tuple[str, str, str] = ("", "", "")
        self.history_tokens = history_tokens

    def static_prompt(self, disabled: frozenset[str] = frozenset()) -> str:
        """Identity and the names of the tools this session may use (a disabled tool is
        named nowhere in its prompt)."""
        disabled = disabled & self._known  # (a frontend names any: never a key of its own)
        prompt = self._static.get(disabled)
        if prompt is None:
            tools = ", ".join(n for n in self._tool_names if n not in disabled) or "none"
            prompt = f"{self._identity}\n\n# Tools\nAvailable tool names: {tools}. Call them with JSON arguments."
            self._static[disabled] = prompt
        return prompt

    def system_prompt(self, memory: str | None, disabled: frozenset[str] = frozenset()) -> str:
        static = self.static_prompt(disabled)
        if not memory:
            return static
        if self._with_memory[:2] != (static, memory):
            full = f"{static}\n\n# Long-term memory\n{memory}"
            self._with_memory = (static, memory, full)
        return self._with_memory[2]

    def build(
        self,
        session: Session,
        user_row: dict[str, Any] | None,
        memory: str | None,
        disabled: frozenset[str] | None = None,
    ) -> list[dict[str, Any]]:
        """``[system, *history, user]``; ``memory`` is None for transient sessions;
        ``user_row`` None: the history ends with the message to answer (a retry);
        ``disabled``: the tools not to name (default: the session's disabled tools)."""
        history = session.get_history(max_tokens=self.history_tokens)
        off = session.policy.disabled_tools if disabled is None else disabled
        prompt = self.system_prompt(memory, off)
        history.insert(0, {"role": "system", "content": prompt})  # (a copy of its own)
        if user_row is not None:
            history.append({"role": "user", "content": user_row["content"]})
        return history
