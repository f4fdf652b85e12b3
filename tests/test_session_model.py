"""Session replay window: the fast path agrees with a plain walk over the history."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from session_store.models import Session, estimate_tokens

ROWS = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "tool"]), "content": st.text(max_size=40)}
    ),
    max_size=40,
)


def naive(session: Session, max_tokens: int) -> list[dict[str, object]]:
    rows = session.messages
    start, budget = len(rows), max_tokens
    while start > session.last_consolidated and budget - estimate_tokens(rows[start - 1]) >= 0:
        start -= 1
        budget -= estimate_tokens(rows[start])
    while start < len(rows) and rows[start]["role"] != "user":
        start += 1
    return [
        {k: v for k, v in r.items() if k in ("role", "content")}
        for r in rows[start:]
        if not (r["role"] == "assistant" and not r["content"])
    ]


@given(ROWS, st.integers(0, 200), st.integers(0, 40))
def test_window_matches_a_plain_walk(
    rows: list[dict[str, str]], budget: int, consolidated: int
) -> None:
    session = Session(key="k")
    session.append_rows(rows)
    session.last_consolidated = min(consolidated, len(rows))
    assert session.get_history(max_tokens=budget) == naive(session, budget)
    expected = sum(estimate_tokens(r) for r in rows[session.last_consolidated :])
    assert session.token_count == expected
