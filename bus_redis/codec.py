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
