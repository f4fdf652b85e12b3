"""Session replay window: the fast path agrees with a plain walk over the history."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

from session_store.models import INTERRUPTED, Session, estimate_tokens, now_iso, pending_calls

_CALL = [{"id": "c1", "type": "function", "function": {"name": "t", "arguments": "{}"}}]
ROWS = st.lists(
    st.one_of(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["user", "assistant", "tool"]),
                "content": st.text(max_size=40),
            }
        ),
        st.fixed_dictionaries(  # a tool call with no text: replayed, not dropped
            {
                "role": st.just("assistant"),
                "content": st.sampled_from(["", None]),
                "tool_calls": st.just(_CALL),
            }
        ),
        st.fixed_dictionaries(
            {
                "role": st.just("tool"),
                "content": st.text(max_size=10),
                "tool_call_id": st.just("c1"),
                "name": st.just("t"),
            }
        ),
    ),
    max_size=40,
)
_REPLAYED = ("role", "content", "tool_calls", "tool_call_id", "name")


def naive(session: Session, max_tokens: int) -> list[dict[str, object]]:
    rows = session.messages
    start, budget = len(rows), max_tokens
    while start > session.last_consolidated and budget - estimate_tokens(rows[start - 1]) >= 0:
        start -= 1
        budget -= estimate_tokens(rows[start])
    while start < len(rows) and rows[start]["role"] != "user":
        start += 1
    window = [
        {k: v for k, v in r.items() if k in _REPLAYED and v is not None}
        for r in rows[start:]
        if not (r["role"] == "assistant" and not r["content"] and not r.get("tool_calls"))
    ]
    if window:  # calls the stored tail never answered are shown answered as interrupted
        window += [
            {"role": "tool", "tool_call_id": cid, "name": name, "content": INTERRUPTED}
            for cid, name in pending_calls(rows)
        ]
    return window


@given(ROWS, st.integers(0, 200), st.integers(0, 40))
def test_window_matches_a_plain_walk(
    rows: list[dict[str, str]], budget: int, consolidated: int
) -> None:
    session = Session(key="k")
    session.append_rows(rows)
    session.last_consolidated = min(consolidated, len(session.messages))
    assert session.get_history(max_tokens=budget) == naive(session, budget)
    stored = session.messages  # as append_rows kept them valid
    expected = sum(estimate_tokens(r) for r in stored[session.last_consolidated :])
    assert session.token_count == expected


@given(ROWS, ROWS, st.integers(0, 200))
def test_window_after_a_rollback_or_a_reload_matches_a_plain_walk(
    kept: list[dict[str, str]], dropped: list[dict[str, str]], budget: int
) -> None:
    """A refused commit rolls the turn's rows back; a copy loaded from stored rows builds
    its views at once: both replay what a plain walk over their rows gives."""
    session = Session(key="k")
    session.append_rows(kept)
    mark = session.mark()
    session.append_rows(dropped)
    session.rollback(mark)
    assert session.get_history(max_tokens=budget) == naive(session, budget)
    again = Session(key="k")
    again.append_rows(kept)
    mark = again.mark()
    again.append_rows(dropped)
    again.rollback(mark)
    again.append_rows(kept)  # the turn goes on, and adds other rows
    assert again.get_history(max_tokens=budget) == naive(again, budget)
    loaded = Session(key="k", messages=[dict(r) for r in session.messages])
    assert loaded.get_history(max_tokens=budget) == naive(loaded, budget)
    loaded.append_rows(dropped)
    assert loaded.get_history(max_tokens=budget) == naive(loaded, budget)


def test_timestamps_are_utc_iso_8601_with_microseconds() -> None:
    """Formatted once a second, then only the microseconds change: every stamp still
    parses, is UTC and is the time it was taken."""
    before = datetime.now(UTC).replace(microsecond=0)
    stamps = [now_iso() for _ in range(1000)]
    after = datetime.now(UTC)
    for stamp in stamps:
        assert stamp.endswith("+00:00")
        assert len(stamp.split("T")[1].split("+")[0].split(".")[1]) == 6
        parsed = datetime.fromisoformat(stamp)
        assert before <= parsed <= after + timedelta(microseconds=1)
    assert stamps == sorted(stamps)
