"""Session and SessionPolicy: the in-memory shape of a conversation."""

from __future__ import annotations

import time
from bisect import bisect_left
from dataclasses import dataclass, field
from datetime import UTC, datetime
from itertools import accumulate
from typing import Any

UNIFIED_SESSION_KEY = "unified:default"
OWNER_SCOPE = "unified/owner"  # single-owner mode: one memory, every session readable
_REPLAY_FIELDS = ("role", "content", "tool_calls", "tool_call_id", "name", "reasoning_content")
DEFAULT_HISTORY_TOKENS = 16_000
INTERRUPTED = "Error: Task interrupted before this tool finished."


def pending_calls(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """``(call id, tool name)`` of the last assistant row's tool calls that no tool row after
    it answers yet (empty once a row other than a tool result follows them)."""
    pending: list[tuple[str, str]] = []
    for i in range(len(rows) - 1, -1, -1):
        row = rows[i]
        if row.get("role") == "tool":
            continue
        if row.get("role") == "assistant" and row.get("tool_calls"):
            pending = [_call(c) for c in row["tool_calls"] if isinstance(c, dict)]
            for later in rows[i + 1 :]:
                _answer(pending, later.get("tool_call_id"))
        break
    return pending


def _call(call: dict[str, Any]) -> tuple[str, str]:
    function = call.get("function") if isinstance(call.get("function"), dict) else {}
    return str(call.get("id") or ""), str((function or {}).get("name") or "")


def _answer(pending: list[tuple[str, str]], call_id: Any) -> bool:
    """Take the first pending call with this id; False when none waits for it."""
    for n, (cid, _name) in enumerate(pending):
        if cid == str(call_id or ""):
            del pending[n]
            return True
    return False


def _project(row: dict[str, Any]) -> dict[str, Any] | None:
    """The LLM view of one stored row (computed once, at append); None = not replayed."""
    if row.get("role") == "assistant" and not row.get("content") and not row.get("tool_calls"):
        return None
    return {k: row[k] for k in _REPLAY_FIELDS if k in row and row[k] is not None}


_second: tuple[int, str] = (-1, "")  # the last whole second formatted, and its text


def now_iso() -> str:
    """The current UTC time as ISO 8601 with microseconds (``...T12:00:00.000001+00:00``);
    the date and time of day are formatted once a second (a turn stamps several rows).
    The pair is replaced whole, so another thread never reads one half of each."""
    global _second
    now = time.time()
    second, text = _second
    if second != int(now):
        second = int(now)
        text = datetime.fromtimestamp(second, UTC).strftime("%Y-%m-%dT%H:%M:%S")
        _second = (second, text)
    return f"{text}.{int((now - second) * 1e6):06d}+00:00"


def estimate_tokens(row: dict[str, Any]) -> int:
    """Cheap token estimate of one message row (~4 characters a token)."""
    content = row.get("content")
    size = len(content) if isinstance(content, str) else len(str(content or ""))
    if row.get("tool_calls"):
        size += len(str(row["tool_calls"]))
    return size // 4 + 4


# rows a turn's load reads besides the unconsolidated ones, and about what a copy kept
# between turns holds (a re-sent message id, a retry, read_session of the current session
# look among them)
RECENT_ROWS = 512


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
    # the stream entry id of the message that started it ('' when not known): what a turn
    # of an earlier conversation under this key (deleted, or ended by new) made, a
    # schedule's firing or a subagent's result, is older and never runs in it
    born: str = ""
    # whose share of the per-scope limits (schedules, sessions running subagents) it
    # counts against: '' = its scope; a frontend's user holding several scopes (a bot's
    # end users behind one account) names one for them all
    quota: str = ""
    policy: SessionPolicy = field(default_factory=SessionPolicy)
    version: int = 0
    generation: str = ""  # of its Redis hash: a re-created hash has a new one
    persisted_count: int = 0
    skipped_rows: int = 0  # rows of its hash that could not be read (left out of messages)
    # rows of its hash before messages[0], consolidated, not loaded (a turn's load reads the
    # unconsolidated rows and the newest few, not the whole history): ``last_consolidated``
    # counts from messages[0]; stored, it counts from the hash's first row (codec)
    base: int = 0
    _replay: list[dict[str, Any]] = field(default_factory=list, repr=False)  # LLM views
    _at: list[int] = field(default_factory=lambda: [0], repr=False)  # views before row i
    _seen_ids: set[str] = field(default_factory=set, repr=False)
    _prefix: list[int] = field(default_factory=lambda: [0], repr=False)  # token prefix sums
    _pending: list[tuple[str, str]] = field(default_factory=list, repr=False)  # unanswered calls

    @property
    def share_owner(self) -> str:
        """What its per-scope shares are counted by: its quota owner, else its scope."""
        return self.quota or self.scope

    def __post_init__(self) -> None:
        if not isinstance(self.metadata, dict):
            self.metadata = {}
        lc = self.last_consolidated
        if isinstance(lc, bool) or not isinstance(lc, int) or not 0 <= lc <= len(self.messages):
            self.last_consolidated = 0
        self._replay, self._at = [], [0]
        for m in self.messages:
            self._view(m)
        self._prefix = list(accumulate((estimate_tokens(m) for m in self.messages), initial=0))
        self._seen_ids = {m["message_id"] for m in self.messages if m.get("message_id")}
        self._pending = pending_calls(self.messages)

    # --- mutation ---------------------------------------------------------------
    def add_message(self, role: str, content: Any, **extra: Any) -> dict[str, Any]:
        row: dict[str, Any] = {"role": role, "content": content, "timestamp": now_iso(), **extra}
        self.append_rows([row])
        return row

    def append_rows(self, rows: list[dict[str, Any]]) -> None:
        """Append rows so that the transcript stays valid, whatever cut the turn that made
        them: each assistant tool call is answered by exactly one tool row before any other
        row (a call left unanswered gets a synthetic ``INTERRUPTED`` result first), and a
        tool row no pending call waits for (an orphan, a duplicate) is dropped."""
        for row in rows:
            if row.get("role") == "tool":
                if _answer(self._pending, row.get("tool_call_id")):
                    self._append(row)
                continue
            self.close_tool_calls()
            self._append(row)
            if row.get("role") == "assistant" and row.get("tool_calls"):
                self._pending = [_call(c) for c in row["tool_calls"] if isinstance(c, dict)]
        if rows:
            self.updated_at = now_iso()

    def extend_stored(self, rows: list[dict[str, Any]]) -> None:
        """Rows read from the stored hash, as they are (each mirrors a hash row: nothing is
        repaired here; a stored open tail is closed in the replay and on the next append)."""
        for row in rows:
            self._append(row)
        self._pending = pending_calls(self.messages)

    def close_tool_calls(self) -> None:
        """Answer every pending tool call with a synthetic ``INTERRUPTED`` result."""
        pending, self._pending = self._pending, []
        for call_id, name in pending:
            self._append(
                {
                    "role": "tool",
                    "tool_call_id": call_id,
                    "name": name,
                    "content": INTERRUPTED,
                    "timestamp": now_iso(),
                }
            )

    def _append(self, row: dict[str, Any]) -> None:
        self.messages.append(row)
        self._view(row)
        self._prefix.append(self._prefix[-1] + estimate_tokens(row))
        if row.get("message_id"):
            self._seen_ids.add(row["message_id"])

    def _view(self, row: dict[str, Any]) -> None:
        """The row's LLM view (computed once) and how many views precede the next row."""
        view = _project(row)
        if view is not None:
            self._replay.append(view)
        self._at.append(len(self._replay))

    def mark(self) -> tuple[int, list[tuple[str, str]], str]:
        """Where the unpersisted tail stands now (for :meth:`rollback`)."""
        return len(self.messages), list(self._pending), self.updated_at

    def rollback(self, mark: tuple[int, list[tuple[str, str]], str]) -> None:
        """Forget the rows appended since ``mark`` (none of them persisted): a commit that
        was refused leaves the session as it was before the turn's rows were added."""
        n, pending, updated_at = mark
        if n < self.persisted_count:
            raise ValueError("rows already persisted cannot be rolled back")
        for row in self.messages[n:]:
            if row.get("message_id"):
                self._seen_ids.discard(row["message_id"])
        del self.messages[n:]
        del self._replay[self._at[n] :]
        del self._at[n + 1 :]
        del self._prefix[n + 1 :]
        self._pending, self.updated_at = pending, updated_at

    def forget_before(self, cut: int) -> None:
        """Drop the first ``cut`` rows from memory (consolidated and stored: they stay in
        the hash, counted in ``base``), so a copy kept between turns holds what a load
        for a turn would read, not every row the session ever had. Between turns only."""
        if not 0 < cut <= min(self.last_consolidated, self.persisted_count):
            raise ValueError("only consolidated, stored rows can be forgotten")
        rows = self.messages[cut:]
        self.base += cut
        self.last_consolidated -= cut
        self.persisted_count -= cut
        self.messages = rows
        self._replay, self._at = [], [0]
        for m in rows:
            self._view(m)
        self._prefix = list(accumulate((estimate_tokens(m) for m in rows), initial=0))
        self._seen_ids = {m["message_id"] for m in rows if m.get("message_id")}

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
    def held_chars(self) -> int:
        """About the characters its rows hold (4 a token, as the history counts them), O(1)."""
        return 4 * self._prefix[-1]

    def first_within(self, rows: int, chars: int | None = None) -> int:
        """The first of the newest ``rows`` rows that hold at most ``chars`` characters
        (``held_chars``' measure): 0 when every row does. O(log n)."""
        start = max(0, len(self.messages) - rows)
        if chars is not None and 4 * (self._prefix[-1] - self._prefix[start]) > chars:
            start = bisect_left(self._prefix, self._prefix[-1] - chars // 4, lo=start)
        return start

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
        rows = self._replay[self._at[start] :]  # one copy of the window's views
        # a stored tail whose calls were never answered (a cut turn of an older version):
        # the model sees them answered as interrupted, as the next append would store them
        if rows and self._pending:  # (the window starts on a user row: the calls are in it)
            rows += [
                {"role": "tool", "tool_call_id": cid, "name": name, "content": INTERRUPTED}
                for cid, name in self._pending
            ]
        return rows
