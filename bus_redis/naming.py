"""What a channel and a session key are, and how a session key is written inside a key
name (percent-encoded, injective). :mod:`bus_redis.keys` builds the key names from these.
"""

from __future__ import annotations

import re
from functools import lru_cache

_ESCAPED = frozenset("{}%") | frozenset(chr(c) for c in range(0x20)) | {"\x7f"}
CHANNEL_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
UNIFIED_CHANNEL = "unified"  # reserved: the channel part of ``unified:default``
MAX_SESSION_KEY = 64 + 1 + 4096  # channel, ':', chat id or override (schema: 4096 at most)
CACHED_KEY_CHARS = 256  # key names of longer session keys are not cached
RESERVED_CHANNELS = frozenset({UNIFIED_CHANNEL})


def valid_channel(channel: str) -> bool:
    """Letters, digits, ``_`` and ``-`` (no ``:``, no glob characters), not reserved."""
    return bool(CHANNEL_RE.fullmatch(channel)) and channel not in RESERVED_CHANNELS


def channel_of(session_key: str) -> str:
    """The channel part of a session key (everything before the first ``:``)."""
    return session_key.partition(":")[0]


def in_channel(session_key: str, channel: str) -> bool:
    """Whether ``session_key`` belongs to ``channel`` (starts with ``channel:``, non-empty
    rest) and is no longer than any key the wire allows (:data:`MAX_SESSION_KEY`): a
    longer one, met in a notification, an index or a key name, is junk."""
    if len(session_key) > MAX_SESSION_KEY:
        return False
    head, sep, rest = session_key.partition(":")
    return head == channel and bool(sep) and bool(rest)


def encode_session(session_key: str) -> str:
    """Percent-encode the characters that could break a key name or its hash tag (cached
    for the short keys every turn names again; a long one is encoded each time, so the
    cache's memory stays bounded)."""
    if len(session_key) <= CACHED_KEY_CHARS:
        return _encode_cached(session_key)
    return _encode(session_key)


def _encode(session_key: str) -> str:
    if not any(ch in _ESCAPED for ch in session_key):
        return session_key
    return "".join(f"%{ord(ch):02X}" if ch in _ESCAPED else ch for ch in session_key)


_encode_cached = lru_cache(maxsize=16_384)(_encode)


def decode_session(encoded: str) -> str:
    """Inverse of :func:`encode_session`."""
    if "%" not in encoded:
        return encoded
    out: list[str] = []
    i = 0
    while i < len(encoded):
        ch = encoded[i]
        if ch == "%":
            digits = encoded[i + 1 : i + 3]
            if len(digits) != 2 or not all(c in "0123456789ABCDEFabcdef" for c in digits):
                raise ValueError(f"bad escape in an encoded session key: {encoded!r}")
            out.append(chr(int(digits, 16)))
            i += 3
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def glob_escape(text: str) -> str:
    """Escape Redis glob characters (for SCAN MATCH / PSUBSCRIBE patterns)."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)
