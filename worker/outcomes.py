"""Building outbound events and dead letters; deciding what a control flag cancels."""

from __future__ import annotations

import json
from typing import Any

from bus_redis import InboundMessage, MessageRejectedError, OutboundMessage
from bus_redis.codec import parse_flag, parse_stream_id
from bus_redis.results import Entry


class SessionNotActiveError(RuntimeError):
    """``require_existing_session`` for a session this worker does not hold."""


class TurnAbortedError(Exception):
    """The turn ended without a result that may be written (lease lost, shutdown)."""


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


def rejection(exc: MessageRejectedError, entry: Entry) -> OutboundMessage | None:
    """The error event of an unreadable payload, when its origin is readable."""
    if not (exc.channel and exc.chat_id):
        return None
    key = exc.session_key or f"{exc.channel}:{exc.chat_id}"
    return error(
        exc.channel, exc.chat_id, key, exc.message_id or entry.entry_id, exc.code, exc.detail
    )


def dead_letter(entry: Entry, reason: str, worker_id: str) -> str:
    return json.dumps(
        {
            "session": entry.member,
            "entry_id": entry.entry_id,
            "payload": entry.payload,
            "reason": reason,
            "deliveries": entry.attempts,
            "worker": worker_id,
        },
        ensure_ascii=False,
    )


def cancelled_by_flag(entry: Entry) -> str | None:
    """The control op (``stop`` / ``discard``) that covers this entry, if any: entries up
    to the flag's boundary id were queued when the control was published."""
    flag = parse_flag(entry.flag)
    if flag is None:
        return None
    op, boundary, _ = flag
    return op if parse_stream_id(entry.entry_id) <= boundary else None


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
