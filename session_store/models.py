"""Session and SessionPolicy: the in-memory shape of a conversation."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from datetime import UTC, datetime
from itertools import accumulate
from typing import Any

UNIFIED_SESSION_KEY = "unified:default"
OWNER_SCOPE = "unified/owner"  # single-owner mode: one memory, every session readable
_REPLAY_FIELDS = ("role", "content", "tool_calls", "tool_call_id", "name", "reasoning_content")
DEFAULT_HISTORY_TOKENS = 16_000


def _project(row: dict[str, Any]) -> dict[str, Any] | None:
    """The LLM view of one stored row (computed once, at append); None = not replayed."""
    if row.get("role") == "assistant" and not row.get("content") and not row.get("tool_calls"):
        return None
    return {k: row[k] for k in _REPLAY_FIELDS if k in row and row[k] is not None}


def now_iso() -> str:
    return datetime.now(UTC).isoformat()


def estimate_tokens(row: dict[str, Any]) -> int:
    """Cheap token estimate of one message row (~4 characters a token)."""
    content = row.get("content")
    size = len(content) if isinstance(content, str) else len(str(content or ""))
    if row.get("tool_calls"):
        size += len(str(row["tool_calls"]))
    return size // 4 + 4


@dataclass(frozen=True, slots=True)
class SessionPolicy:
    """Runtime rules that are not session data: a transient session does not persist."""

    persist: bool = True
    log_content: bool = True
    disabled_tools: frozenset[str] = frozenset()


TRANSIENT = SessionPolicy(persist=False, log_content=False)


@dataclass(eq=False)
class Session:
    """One conversation. ``version``/``persisted_count`` tie it to its Redis hash."""

    key: str
    messages: list[dict[str, Any]] = field(default_factory=list)
    created_at: str = field(default_factory=now_iso)
    updated_at: str = field(default_factory=now_iso)
    metadata: dict[str, Any] = field(default_factory=dict)
    last_consolidated: int = 0
    scope: str = ""  # "<channel>/<name>": whose memory and sessions this session may see
    policy: SessionPolicy = field(default_factory=SessionPolicy)
    version: int = 0
    generation: str = ""  # of its Redis hash: a re-created hash has a new one
    persisted_count: int = 0
    skipped_rows: int = 0  # rows of its hash that could not be read (left out of messages)
    _replay: list[dict[str, Any] | None] = field(default_factory=list, repr=False)
    _seen_ids: set[str] = field(default_factory=set, repr=False)
    _prefix: list[int] = field(default_factory=lambda: [0], repr=False)  # token prefix sums

    def __post_init__(self) -> None:
        if not isinstance(self.metadata, dict):
            self.metadata = {}
        lc = self.last_consolidated
        if isinstance(lc, bool) or not isinstance(lc, int) or not 0 <= lc <= len(self.messages):
            self.last_consolidated = 0
        self._replay = [_project(m) for m in self.messages]
        self._prefix = list(accumulate((estimate_tokens(m) for m in self.messages), initial=0))
        self._seen_ids = {m["message_id"] for m in self.messages if m.get("message_id")}

    # --- mutation ---------------------------------------------------------------
    def add_message(self, role: str, content: Any, **extra: Any) -> dict[str, Any]:
        row: dict[str, Any] = {"role": role, "content": content, "timestamp": now_iso(), **extra}
        self.append_rows([row])
        return row

    def append_rows(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            self.messages.append(row)
            self._replay.append(_project(row))
            self._prefix.append(self._prefix[-1] + estimate_tokens(row))
            if row.get("message_id"):
                self._seen_ids.add(row["message_id"])
        if rows:
            self.updated_at = now_iso()

    def unpersisted(self) -> list[dict[str, Any]]:
        return self.messages[self.persisted_count :]

    def mark_persisted(self, version: int, generation: str | None = None) -> None:
        self.persisted_count = len(self.messages)
        self.version = version
        if generation is not None:
            self.generation = generation

    def answer_to(self, message_id: str) -> str | None:
        """The final answer given to the user row ``message_id``, if it is still here."""
        for i in range(len(self.messages) - 1, -1, -1):
            if self.messages[i].get("message_id") == message_id:
                for row in self.messages[i + 1 :]:
                    if row.get("role") == "user":
                        return None
                    if row.get("role") == "assistant" and not row.get("tool_calls"):
                        content = row.get("content")
                        return content if isinstance(content, str) else None
                return None
        return None

    def has_seen(self, message_id: str | None) -> bool:
        return bool(message_id) and message_id in self._seen_ids

    @property
    def token_count(self) -> int:
        """Estimated tokens of the unconsolidated history, O(1)."""
        return self._prefix[-1] - self._prefix[self.last_consolidated]

    # --- replay -----------------------------------------------------------------
    def get_history(self, *, max_tokens: int = DEFAULT_HISTORY_TOKENS) -> list[dict[str, Any]]:
        """The LLM replay view: unconsolidated rows within a token budget.

        Token prefix sums find the window in O(log n); the rows are projected once, at
        append, so a turn's cost is bounded by the budget, not by the whole history. Starts on a user row; never starts with an
        orphan tool result.
        """
        # smallest start >= last_consolidated whose suffix fits the budget: O(log n)
        start = bisect_left(self._prefix, self._prefix[-1] - max_tokens, lo=self.last_consolidated)
        while start < len(self.messages) and self.messages[start].get("role") != "user":
            start += 1
        return [row for row in self._replay[start:] if row is not None]
