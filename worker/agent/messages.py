"""A message as its session keeps it: the user row a turn appends, and how a message sent
again (its client ``id`` seen before) is told apart: a duplicate, or a retry of a turn
that ended at a provider error. Pure of Redis."""

from __future__ import annotations

from typing import Any

from bus_redis import InboundMessage
from session_store import Session
from session_store.models import now_iso


def message_key(msg: InboundMessage, reply_to: str, *, folded: bool) -> str:
    """What a user row remembers as its ``message_id``: the client id (or the entry id),
    qualified by the session key when several streams share one session (unified mode),
    since neither client ids nor entry ids are unique across streams."""
    return f"{msg.session_key}|{reply_to}" if folded else reply_to


def is_duplicate(msg: InboundMessage, session: Session, key: str) -> bool:
    """A re-sent client ``id``; messages without one are never duplicates."""
    return bool(msg.id) and session.has_seen(key)


RETRY_LOOKBACK = 256  # rows looked at for a re-sent id's unanswered user row


def is_unanswered_retry(msg: InboundMessage, session: Session, key: str) -> bool:
    """A re-sent client ``id`` whose turn ended at a provider error: its user row is
    followed by nothing but the complete tool exchanges that turn made (kept, so that their
    effects are in the history). It is answered now, from there (the row is kept once)."""
    if not msg.id or not session.messages or not session.has_seen(key):
        return False
    for row in reversed(session.messages[-RETRY_LOOKBACK:]):
        if row.get("role") == "user":
            return row.get("message_id") == key
        if row.get("role") != "tool" and not row.get("tool_calls"):
            return False  # an answer came after it
    return False


def user_row(msg: InboundMessage, message_id: str) -> dict[str, Any]:
    content = (
        msg.content if msg.is_user_input else f"[system message from {msg.sender_id}] {msg.content}"
    )
    row: dict[str, Any] = {
        "role": "user",
        "content": content,
        "timestamp": now_iso(),
        "message_id": message_id,
    }
    if msg.media:
        row["media"] = list(msg.media)
    if msg.sender_id:
        row["sender_id"] = msg.sender_id
    return row
