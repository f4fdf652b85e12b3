"""Building outbound events and dead letters; deciding what a control flag cancels."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from bus_redis import InboundMessage, MessageRejectedError, OutboundMessage
from bus_redis.codec import clean
from bus_redis.keys import channel_of
from bus_redis.results import Entry


class SessionNotActiveError(RuntimeError):
    """``require_existing_session`` for a session this worker does not hold."""


class TurnAbortedError(Exception):
    """The turn ended without a result that may be written (lease lost, shutdown)."""


class ScopeMismatchError(ValueError):
    """A user message asks for another scope than its session's."""


def reply(
    msg: InboundMessage, key: str, reply_to: str, content: str, **extra: Any
) -> OutboundMessage:
    return OutboundMessage(
        type="message",
        channel=msg.channel,
        chat_id=msg.chat_id,
        session_key=key,
        reply_to=reply_to,
        content=content,
        **extra,
    )


def error(
    channel: str, chat_id: str, key: str, reply_to: str | None, code: str, detail: str
) -> OutboundMessage:
    return OutboundMessage(
        type="error",
        channel=channel,
        chat_id=chat_id,
        session_key=key,
        reply_to=reply_to,
        content=detail,
        code=code,
    )


def rejection(exc: MessageRejectedError, entry: Entry) -> OutboundMessage:
    """The error event of an unreadable payload, on the stream it came from."""
    member = entry.member
    chat_id = member.partition(":")[2]
    if exc.chat_id and exc.channel == channel_of(member):
        chat_id = clean(exc.chat_id)
    reply_to = clean(exc.message_id) if exc.message_id else entry.entry_id
    return error(channel_of(member), chat_id, member, reply_to, exc.code, clean(exc.detail))


DEAD_LETTER_KEEP_BYTES = 64 * 1024  # a larger payload keeps a prefix, its size and a hash
DEAD_LETTER_REASON_CHARS = 1024  # of the reason (a rejection's detail, an exception's text)


def dead_letter(entry: Entry, reason: str, worker_id: str, *, private: bool) -> str:
    """A dead-letter record; a private session's keeps nothing of the text (size and a
    hash only), and an oversized payload only its first 64 KiB (dead letters do not
    expire: a frontend must not be able to park megabytes there)."""
    raw = entry.payload.encode("utf-8", "surrogateescape")
    doc: dict[str, Any] = {
        "session": entry.member,
        "entry_id": entry.entry_id,
        "reason": clean(reason[:DEAD_LETTER_REASON_CHARS]),
        "deliveries": entry.attempts,
        "worker": worker_id,
        "bytes": len(raw),
        "sha256": hashlib.sha256(raw).hexdigest(),
    }
    if private:
        doc["private"] = True
    elif len(raw) > DEAD_LETTER_KEEP_BYTES:
        doc["payload_prefix"] = raw[:DEAD_LETTER_KEEP_BYTES].decode("utf-8", "replace")
    else:
        doc["payload"] = clean(entry.payload)
    return json.dumps(doc, ensure_ascii=False)


def looks_private(payload: str) -> bool:
    """Whether a (possibly invalid) payload may belong to a private session: it says so
    (in any form), or it cannot be read well enough to tell. Its dead letter then keeps
    no text, whichever worker writes it."""
    try:
        doc = json.loads(payload)
    except (ValueError, RecursionError):
        return True
    if not isinstance(doc, dict):
        return True
    flag = doc.get("require_existing_session")
    private_flag = flag is not None and flag is not False  # 0, "yes", ... may mean it
    return private_flag or doc.get("op") == "open_transient"


def legal_prefix(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows up to the last complete tool exchange (a stopped turn keeps no orphan calls)."""
    keep = len(rows)
    i = 0
    while i < len(rows):
        row = rows[i]
        if row.get("role") == "assistant" and row.get("tool_calls"):
            wanted = {c.get("id") for c in row["tool_calls"]}
            j = i + 1
            while j < len(rows) and rows[j].get("role") == "tool":
                wanted.discard(rows[j].get("tool_call_id"))
                j += 1
            if wanted:
                keep = i
                break
            i = j
            continue
        i += 1
    return rows[:keep]
