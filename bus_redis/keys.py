"""Every Redis key name of the project is built here, and only here.

Wire v2 layout: every key that belongs to a channel ``C`` carries the hash tag ``{C}``,
so one session's keys, its channel's ready queue and its channel's registries share a
Redis Cluster slot, and a Redis ACL can confine a frontend to ``P:{C}:...`` key patterns.

A session key ``S`` always starts with ``C:`` (its channel). Inside a key name ``S`` is
percent-encoded: ``{``, ``}``, ``%`` and the ASCII control characters become ``%XX``
(uppercase hex). The mapping is injective, so no crafted chat id can name another
session's keys. Channel names are restricted (:data:`CHANNEL_RE`) so that they are safe
inside an ACL key pattern. What a channel and a session key are, and how one is
encoded, is in :mod:`bus_redis.naming` (re-exported here).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from bus_redis.naming import (
    CACHED_KEY_CHARS,
    CHANNEL_RE,
    MAX_SESSION_KEY,
    RESERVED_CHANNELS,
    UNIFIED_CHANNEL,
    channel_of,
    decode_session,
    encode_session,
    glob_escape,
    in_channel,
    valid_channel,
)

__all__ = [
    "CHANNEL_RE",
    "MAX_SESSION_KEY",
    "RESERVED_CHANNELS",
    "UNIFIED_CHANNEL",
    "Keys",
    "channel_of",
    "decode_session",
    "encode_session",
    "glob_escape",
    "in_channel",
    "valid_channel",
]


@dataclass(frozen=True, slots=True)
class Keys:
    """Key names under one prefix ``P`` (``AGENT_KEY_PREFIX``)."""

    prefix: str = "agent"

    # --- global (worker-only) keys ------------------------------------------------
    @property
    def channels(self) -> str:
        """Set of registered frontend channels (written by operators, read by workers)."""
        return f"{self.prefix}:channels"

    @property
    def removed_channels(self) -> str:
        """Set of channels an operator removed: discovery does not register them again."""
        return f"{self.prefix}:channels:removed"

    @property
    def alive(self) -> str:
        """Sorted set: worker id -> Redis time of its last liveness beat (ms)."""
        return f"{self.prefix}:alive"

    @property
    def workers(self) -> str:
        """Sorted set: worker id -> last heartbeat (ms)."""
        return f"{self.prefix}:workers"

    @property
    def discovery(self) -> str:
        """String: channel discovery's SCAN cursor, shared by whoever sweeps."""
        return f"{self.prefix}:discovery"

    @property
    def mode(self) -> str:
        """The session mode the workers on this Redis run in (per-session, single-owner,
        unified): set by the first worker, checked by every later one."""
        return f"{self.prefix}:mode"

    @property
    def jobs(self) -> str:
        """The background job queue (arq's sorted set; arq's own keys are ``arq:*``)."""
        return f"{self.prefix}:jobs"

    @property
    def sweeper(self) -> str:
        """Short-lived lock: which worker runs the stranded-stream sweep this period."""
        return f"{self.prefix}:sweeper"

    def inbox(self, worker_id: str) -> str:
        """A worker's own notification stream (transient sessions it owns)."""
        return f"{self.prefix}:worker:{encode_session(worker_id)}:inbox"

    def worker_info(self, worker_id: str) -> str:
        return f"{self.prefix}:worker:{encode_session(worker_id)}:info"

    def worker_jobs(self, worker_id: str, kind: str = "jobs") -> str:
        """Hash: job id -> its name and arguments (JSON), of the background jobs the worker
        runs now: a survivor that judges it dead runs them again at once. Consolidations
        under ``jobs``, subagents under ``subagents`` (a worker older than that hash reads
        every entry of ``jobs`` as a consolidation and queues it again unchecked)."""
        return f"{self.prefix}:worker:{encode_session(worker_id)}:{kind}"

    # --- per channel {C} -------------------------------------------------------------
    def ready(self, channel: str) -> str:
        """The channel's queue of session notifications (group ``workers``)."""
        return f"{self.prefix}:{{{channel}}}:ready"

    def control(self, channel: str) -> str:
        """Pub/sub channel of the channel's controls."""
        return f"{self.prefix}:{{{channel}}}:control"

    @property
    def control_pattern(self) -> str:
        """PSUBSCRIBE pattern matching every channel's control channel."""
        return f"{glob_escape(self.prefix)}:{{*}}:control"

    @property
    def ready_pattern(self) -> str:
        return f"{glob_escape(self.prefix)}:{{*}}:ready"

    @property
    def inbound_pattern(self) -> str:
        return f"{glob_escape(self.prefix)}:{{*}}:in:*"

    @property
    def hint_pattern(self) -> str:
        return f"{glob_escape(self.prefix)}:{{*}}:ctl:*"

    def inbound_of_hint(self, key: str) -> str | None:
        """The inbound stream beside a control hint key (None for a foreign name)."""
        head = f"{self.prefix}:{{"
        channel, sep, rest = (
            key[len(head) :].partition("}:ctl:") if key.startswith(head) else ("", "", "")
        )
        return f"{self.prefix}:{{{channel}}}:in:{rest}" if sep else None

    def dead(self, channel: str) -> str:
        return f"{self.prefix}:{{{channel}}}:dead"

    def sessions_index(self, channel: str) -> str:
        """Sorted set of the channel's durable sessions by updated time (ms)."""
        return f"{self.prefix}:{{{channel}}}:sessions"

    def queued(self, channel: str) -> str:
        """Sorted set: the channel's sessions that may have queued entries -> when the
        stranded-stream sweep looks at them next (ms; 0 = at once). A frontend adds its
        session at publish (``ZADD NX 0``); the sweep reschedules and removes members."""
        return f"{self.prefix}:{{{channel}}}:queued"

    def leases(self, channel: str) -> str:
        """Sorted set: effective key -> lease expiry (ms); swept for dead holders."""
        return f"{self.prefix}:{{{channel}}}:leases"

    def owners(self, channel: str) -> str:
        """Sorted set: transient session key -> owner record expiry (ms)."""
        return f"{self.prefix}:{{{channel}}}:owners"

    # --- the gateway's own keys of channel C: P:{C}:gw:* (docs/ACL.md, role gateway) ------
    def gw_sessions(self, channel: str, user_hash: str) -> str:
        """Sorted set: a gateway user's durable chat ids -> created (ms)."""
        return f"{self.prefix}:{{{channel}}}:gw:user:{user_hash}:sessions"

    def gw_temporary(self, channel: str, user_hash: str) -> str:
        """Sorted set: a gateway user's open temporary chat ids -> created (ms); no text."""
        return f"{self.prefix}:{{{channel}}}:gw:user:{user_hash}:temporary"

    def gw_titles(self, channel: str, user_hash: str) -> str:
        """Hash: a gateway user's chat id -> title."""
        return f"{self.prefix}:{{{channel}}}:gw:user:{user_hash}:titles"

    def gw_waiting(self, channel: str, user_hash: str) -> str:
        """Sorted set: the user's chats the gateway last wrote to (session key -> ms), read
        to count the chats with entries waiting (``gateway.backlog``)."""
        return f"{self.prefix}:{{{channel}}}:gw:user:{user_hash}:waiting"

    def gw_ticket_secret(self, channel: str) -> str:
        """The key the channel's gateway replicas sign tickets with (string, no TTL)."""
        return f"{self.prefix}:{{{channel}}}:gw:ticket:secret"

    def gw_wake(self, channel: str, replica: str) -> str:
        """Stream a gateway replica adds to, to wake its own blocked event read."""
        return f"{self.prefix}:{{{channel}}}:gw:wake:{encode_session(replica)}"

    def pulse(self, channel: str) -> str:
        """Stream: the name of an event stream of the channel each time an event is added
        to it (field ``o``): a frontend following many sessions blocks on this one key."""
        return f"{self.prefix}:{{{channel}}}:pulse"

    def cron_defs(self, channel: str) -> str:
        """Hash: schedule id -> its definition (JSON; ``worker.jobs.schedules``)."""
        return f"{self.prefix}:{{{channel}}}:cron:defs"

    def cron_due(self, channel: str) -> str:
        """Sorted set: schedule id -> its next firing (ms)."""
        return f"{self.prefix}:{{{channel}}}:cron:due"

    def cron_scope_of(self, channel: str) -> str:
        """Hash: schedule id -> the scope of its session."""
        return f"{self.prefix}:{{{channel}}}:cron:scope-of"

    def cron_per_scope(self, channel: str) -> str:
        """Hash: scope -> how many schedules its sessions hold (at most
        ``AGENT_CRON_MAX_PER_SCOPE``)."""
        return f"{self.prefix}:{{{channel}}}:cron:per-scope"

    def subagents(self, channel: str) -> str:
        """Sorted set: session key -> when it last spawned a subagent (``status`` lists)."""
        return f"{self.prefix}:{{{channel}}}:subagents"

    def subagent_scopes(self, channel: str) -> str:
        """Hash: session key -> its scope, of the sessions in ``subagents`` (the share of
        one scope is counted from these)."""
        return f"{self.prefix}:{{{channel}}}:subagents:scopes"

    # --- per scope (lives in the slot of its channel) -------------------------------------
    def scope_sessions(self, scope: str) -> str:
        """Sorted set of the durable sessions of one scope (session tools read only these)."""
        return _scoped(self.prefix, scope, "sessions")

    def memory(self, scope: str) -> str:
        """Hash holding one scope's long-term memory and its version."""
        return _scoped(self.prefix, scope, "memory")

    def memory_history(self, scope: str) -> str:
        """Stream: one scope's archive of dated consolidation entries (field ``entry``)."""
        return _scoped(self.prefix, scope, "history")

    # --- per session S (or effective key K), hash tag {channel of S} -------------------
    def inbound(self, session_key: str) -> str:
        """The session's own stream: unprocessed inbound entries, in publish order."""
        return _session_key(self.prefix, "in", session_key)

    def control_hint(self, session_key: str) -> str:
        """Counter: control markers may be queued in the session's stream."""
        return _session_key(self.prefix, "ctl", session_key)

    def out(self, session_key: str) -> str:
        """The session's events (replies, deltas, progress), bounded in length and time."""
        return _session_key(self.prefix, "out", session_key)

    def session(self, session_key: str) -> str:
        """Hash of a durable session (metadata, counters, one field per message)."""
        return _session_key(self.prefix, "session", session_key)

    def lease(self, session_key: str) -> str:
        """``<nonce>|<worker id>`` with a PX TTL: who may run and write this session."""
        return _session_key(self.prefix, "lease", session_key)

    def pending(self, session_key: str) -> str:
        """Set of inbound streams the lease holder of this effective key must drain."""
        return _session_key(self.prefix, "pending", session_key)

    def owner(self, session_key: str) -> str:
        """Content-free owner record of a transient session (hash, TTL)."""
        return _session_key(self.prefix, "owner", session_key)

    def private_end(self, session_key: str) -> str:
        """Per-session mode: a content-free string (Redis ms) with a TTL, when the private
        session last open on the key ended by a control or was reported lost: a ``new``
        marker published before then was its, a discard however late it is reached."""
        return _session_key(self.prefix, "ended", session_key)

    def private_mark(self, session_key: str) -> str:
        """Unified mode: a content-free string with a TTL, the session was opened private.
        Set when its opening is handled, renewed with the owner record and kept for
        ``RedisBus.private_mark_ms`` after the session ends, so that a ``new`` reached on
        its stream then is a discard, never a fold of the shared session."""
        return _session_key(self.prefix, "private", session_key)

    def journal(self, session_key: str) -> str:
        """Hash: the tool journal of the turn running under effective key K (worker-only)."""
        return _session_key(self.prefix, "journal", session_key)

    def crons(self, session_key: str) -> str:
        """Set: the ids of the session's schedules (deleted with the session)."""
        return _session_key(self.prefix, "crons", session_key)

    def spawned(self, session_key: str) -> str:
        """Hash: subagent id -> what it does, of the session's running subagents."""
        return _session_key(self.prefix, "spawned", session_key)

    def release(self, key: str, lease: str) -> list[str]:
        """The KEYS of ``lua/release.lua`` for effective key ``K`` held under ``lease``: with
        K's own inbound stream, attempts hash and control hint when K is one (every key
        but the unified one, under which streams are folded)."""
        channel = channel_of(key)
        keys = [lease, self.pending(key), self.ready(channel), self.leases(channel)]
        if channel != UNIFIED_CHANNEL:
            keys += [self.inbound(key), self.attempts(key), self.control_hint(key)]
        return keys

    def deletion(self, session_key: str, lease: str, scope: str) -> list[str]:
        """The KEYS of ``lua/delete.lua`` for session ``S`` (fenced by ``lease``)."""
        channel = channel_of(session_key)
        index = self.sessions_index(channel)
        return [
            lease,
            self.session(session_key),
            index,
            self.scope_sessions(scope) if scope else index,
            self.out(session_key),
            self.journal(session_key),
            self.crons(session_key),
            self.cron_defs(channel),
            self.cron_due(channel),
            self.spawned(session_key),
            self.subagents(channel),
            self.subagent_scopes(channel),
            self.cron_scope_of(channel),
            self.cron_per_scope(channel),
        ]

    def attempts(self, session_key: str) -> str:
        """Hash: inbound entry id -> delivery attempts."""
        return _session_key(self.prefix, "attempts", session_key)

    def session_of_inbound(self, key: str) -> str | None:
        """The session key of an inbound stream name (inverse of :meth:`inbound`); None
        for a name no session key produces (a malformed or foreign name a frontend wrote)."""
        head = f"{self.prefix}:{{"
        if not key.startswith(head):
            return None
        channel, sep, rest = key[len(head) :].partition("}:in:")
        if not sep:
            return None
        try:
            session_key = decode_session(rest)
        except ValueError:
            return None
        if not in_channel(session_key, channel) or self.inbound(session_key) != key:
            return None
        return session_key

    def channel_of_ready(self, key: str) -> str | None:
        head, tail = f"{self.prefix}:{{", "}:ready"
        if key.startswith(head) and key.endswith(tail):
            channel = key[len(head) : -len(tail)]
            return channel if valid_channel(channel) else None
        return None

    def channel_of_control(self, name: str) -> str | None:
        head, tail = f"{self.prefix}:{{", "}:control"
        if name.startswith(head) and name.endswith(tail):
            channel = name[len(head) : -len(tail)]
            return channel if valid_channel(channel) else None
        return None


def _session_key(prefix: str, kind: str, session_key: str) -> str:
    """``P:{C}:kind:S``. The parts around ``kind`` are cached per short session key (one
    entry per session, whatever the number of kinds a turn names: 10,000 sessions in
    flight name ~150,000 keys, which a cache per key name would thrash)."""
    if len(session_key) <= CACHED_KEY_CHARS:
        head, tail = _session_parts_cached(prefix, session_key)
    else:
        head, tail = _session_parts(prefix, session_key)
    return head + kind + tail


def _session_parts(prefix: str, session_key: str) -> tuple[str, str]:
    channel = encode_session(channel_of(session_key))  # validated upstream; encoded anyway
    return f"{prefix}:{{{channel}}}:", f":{encode_session(session_key)}"


_session_parts_cached = lru_cache(maxsize=32_768)(_session_parts)


def _scoped(prefix: str, scope: str, kind: str) -> str:
    """A scope is ``<channel>/<name>``: its keys live in its channel's slot. The part
    before ``kind`` is cached per short scope (a turn names its memory and its index)."""
    if len(scope) <= CACHED_KEY_CHARS:
        return _scope_head_cached(prefix, scope) + kind
    return _scope_head(prefix, scope) + kind


def _scope_head(prefix: str, scope: str) -> str:
    channel, _, name = scope.partition("/")
    return f"{prefix}:{{{encode_session(channel)}}}:scope:{encode_session(name)}:"


_scope_head_cached = lru_cache(maxsize=16_384)(_scope_head)
