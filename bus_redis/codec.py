"""Decoding of loosely typed redis-py replies into plain Python values."""

from __future__ import annotations

import itertools
import os
import secrets
from typing import Any

from redis.asyncio import Redis


def text(value: Any) -> str:
    """A reply value as ``str`` (clients may or may not decode responses)."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return "" if value is None else str(value)


def safe(value: Any, limit: int = 200) -> str:
    """A value from the wire, fit for a log line: control characters escaped, bounded."""
    s = text(value)
    if len(s) > limit:
        s = s[:limit] + "..."
    return (
        s.encode("unicode_escape", "backslashreplace").decode("ascii") if not s.isprintable() else s
    )


async def server_ms(redis: Redis) -> int:
    """Redis's clock, ms: what records compared across hosts are stamped and judged with
    (each host's own clock may be off)."""
    seconds, micros = await redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


def texts(values: Any) -> list[str]:
    return [
        v.decode("utf-8", errors="replace") if v.__class__ is bytes else text(v)
        for v in values or []
    ]


def fields(pairs: Any) -> dict[str, str]:
    """A stream entry's field list or dict as ``dict[str, str]``."""
    if isinstance(pairs, dict):
        return {text(k): text(v) for k, v in pairs.items()}
    items = list(pairs or [])
    return {text(items[i]): text(items[i + 1]) for i in range(0, len(items) - 1, 2)}


_nonce_prefix = secrets.token_hex(8)
_nonce_count = itertools.count()


def _reseed() -> None:
    global _nonce_prefix, _nonce_count
    _nonce_prefix, _nonce_count = secrets.token_hex(8), itertools.count()


os.register_at_fork(after_in_child=_reseed)  # a forked child never repeats its parent's


def fresh_nonce() -> str:
    """A value never handed out before, by any process: 64 random bits drawn once per
    process (and again in a forked child), then a counter (a lease nonce, a new session's
    generation: two a turn, without a system call for randomness each)."""
    return f"{_nonce_prefix}{next(_nonce_count):x}"


def _number(part: str) -> int | None:
    """An id's part when it is 1-20 ASCII digits (``str.isdigit`` takes "²" too, which
    ``int`` refuses: an id comes from a frontend as often as from Redis)."""
    return int(part) if 0 < len(part) <= 20 and part.isascii() and part.isdigit() else None


def stream_id_ms(entry_id: str) -> int:
    """Milliseconds part of a stream entry id ``<ms>-<seq>`` (0 when malformed)."""
    return _number(entry_id.partition("-")[0]) or 0


def parse_stream_id(entry_id: str) -> tuple[int, int]:
    """``<ms>-<seq>`` as a sortable pair; malformed ids sort first."""
    head, _, tail = entry_id.partition("-")
    ms = _number(head)
    if ms is None:
        return (0, 0)
    return (ms, _number(tail) or 0)


def payload_text(value: Any) -> str:
    """An inbound payload as ``str``; bytes that are not UTF-8 are kept as surrogates so
    that validation can reject them (``schema.decode_inbound``)."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="surrogateescape")
    return "" if value is None else str(value)


def clean(value: str) -> str:
    """A string that can be encoded as UTF-8 (lone surrogates replaced)."""
    try:
        value.encode("utf-8")
        return value
    except UnicodeEncodeError:
        return value.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def strict_text(value: Any) -> str | None:
    """A reply value as ``str``, or None when its bytes are not UTF-8 (junk from the wire)."""
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return None
    return None if value is None else str(value)


def binary_twin(redis: Redis) -> Redis:
    """A client on the same server that returns bytes (``decode_responses=False``): for
    replies that may carry bytes from the wire that are not UTF-8 (pub/sub, queues, SCAN),
    which a decoding client would fail to parse."""
    pool = redis.connection_pool
    kwargs = dict(pool.connection_kwargs)
    kwargs["decode_responses"] = False
    twin_pool = pool.__class__(connection_class=pool.connection_class, **kwargs)
    if type(redis).__module__.startswith("fakeredis"):
        return Redis(connection_pool=twin_pool)
    return type(redis)(connection_pool=twin_pool)  # keeps subclasses (a counting client)
