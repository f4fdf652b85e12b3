"""Every Redis key name of the project is built here, and only here.

A session key ``S`` is percent-encoded before it enters a key name: ``{``, ``}``,
``%`` and the ASCII control characters become ``%XX`` (uppercase hex). The mapping
is injective, so no crafted chat id can name another session's keys, and all keys
of one session share the Redis Cluster hash tag ``{S}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

_ESCAPED = frozenset("{}%") | frozenset(chr(c) for c in range(0x20)) | {"\x7f"}


@lru_cache(maxsize=16_384)
def encode_session(session_key: str) -> str:
    """Percent-encode the characters that could break a key name or its hash tag."""
    if not any(ch in _ESCAPED for ch in session_key):
        return session_key
    return "".join(f"%{ord(ch):02X}" if ch in _ESCAPED else ch for ch in session_key)


def decode_session(encoded: str) -> str:
    """Inverse of :func:`encode_session`."""
    if "%" not in encoded:
        return encoded
    out: list[str] = []
    i = 0
    while i < len(encoded):
        ch = encoded[i]
        if ch == "%":
            out.append(chr(int(encoded[i + 1 : i + 3], 16)))
            i += 3
        else:
            out.append(ch)
            i += 1
    return "".join(out)


@dataclass(frozen=True, slots=True)
class Keys:
    """Key names under one prefix (``AGENT_KEY_PREFIX``)."""

    prefix: str = "agent"

    # --- shared keys -------------------------------------------------------------
    @property
    def ready(self) -> str:
        """The one shared queue of session notifications every worker reads."""
        return f"{self.prefix}:ready"

    @property
    def control(self) -> str:
        """Pub/sub channel of control messages."""
        return f"{self.prefix}:control"

    @property
    def dead(self) -> str:
        return f"{self.prefix}:dead"

    @property
    def sessions_index(self) -> str:
        """Sorted set of durable sessions by updated time (ms)."""
        return f"{self.prefix}:sessions"

    @property
    def leases(self) -> str:
        """Sorted set: effective session key -> lease expiry (ms); swept for dead holders."""
        return f"{self.prefix}:leases"

    @property
    def owners(self) -> str:
        """Sorted set: transient session key -> owner record expiry (ms)."""
        return f"{self.prefix}:owners"

    @property
    def workers(self) -> str:
        """Sorted set: worker id -> last heartbeat (ms)."""
        return f"{self.prefix}:workers"

    @property
    def memory(self) -> str:
        """Hash holding the durable long-term memory and its version."""
        return f"{self.prefix}:memory"

    def out(self, channel: str) -> str:
        """Outbound stream of one frontend channel."""
        return f"{self.prefix}:out:{encode_session(channel)}"

    def inbox(self, worker_id: str) -> str:
        """A worker's own notification stream (transient sessions it owns)."""
        return f"{self.prefix}:worker:{encode_session(worker_id)}:inbox"

    def worker_info(self, worker_id: str) -> str:
        return f"{self.prefix}:worker:{encode_session(worker_id)}:info"

    # --- per-session keys (hash tag {S}) -------------------------------------------
    def _s(self, session_key: str, suffix: str) -> str:
        return _session_key(self.prefix, session_key, suffix)

    def inbound(self, session_key: str) -> str:
        """The session's own stream: unprocessed inbound entries, in publish order."""
        return self._s(session_key, "in")

    def session(self, session_key: str) -> str:
        """Hash of a durable session (metadata, counters, one field per message)."""
        return self._s(session_key, "session")

    def lease(self, session_key: str) -> str:
        """``<epoch>|<worker id>`` with a PX TTL: who may run and write this session."""
        return self._s(session_key, "lease")

    def epoch(self, session_key: str) -> str:
        """Fencing counter, INCR on every lease acquisition."""
        return self._s(session_key, "epoch")

    def pending(self, session_key: str) -> str:
        """Set of inbound streams the lease holder of this effective key must drain."""
        return self._s(session_key, "pending")

    def owner(self, session_key: str) -> str:
        """Content-free owner record of a transient session (hash, TTL)."""
        return self._s(session_key, "owner")

    def control_flag(self, session_key: str) -> str:
        """Short-lived record of the last control, for workers that missed the pub/sub."""
        return self._s(session_key, "ctl")

    def attempts(self, session_key: str) -> str:
        """Hash: inbound entry id -> delivery attempts."""
        return self._s(session_key, "attempts")


@lru_cache(maxsize=65_536)
def _session_key(prefix: str, session_key: str, suffix: str) -> str:
    """``P:{S}:suffix``; cached, since a turn names the same few keys many times."""
    return f"{prefix}:{{{encode_session(session_key)}}}:{suffix}"
