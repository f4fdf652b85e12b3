"""Decoding of loosely typed redis-py replies into plain Python values."""

from __future__ import annotations

from typing import Any


def text(value: Any) -> str:
    """A reply value as ``str`` (clients may or may not decode responses)."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return "" if value is None else str(value)


def texts(values: Any) -> list[str]:
    return [text(v) for v in values or []]


def fields(pairs: Any) -> dict[str, str]:
    """A stream entry's field list or dict as ``dict[str, str]``."""
    if isinstance(pairs, dict):
        return {text(k): text(v) for k, v in pairs.items()}
    items = list(pairs or [])
    return {text(items[i]): text(items[i + 1]) for i in range(0, len(items) - 1, 2)}


def stream_id_ms(entry_id: str) -> int:
    """Milliseconds part of a stream entry id ``<ms>-<seq>``."""
    head, _, _ = entry_id.partition("-")
    return int(head) if head.isdigit() else 0


def parse_stream_id(entry_id: str) -> tuple[int, int]:
    """``<ms>-<seq>`` as a sortable pair; malformed ids sort first."""
    head, _, tail = entry_id.partition("-")
    if not head.isdigit():
        return (0, 0)
    return (int(head), int(tail) if tail.isdigit() else 0)


def parse_flag(flag: str) -> tuple[str, tuple[int, int], int] | None:
    """A control flag ``"<op> <boundary entry id> <server ms>"``, or None."""
    parts = flag.split()
    if len(parts) != 3 or parts[0] not in ("stop", "discard") or not parts[2].isdigit():
        return None
    return parts[0], parse_stream_id(parts[1]), int(parts[2])
