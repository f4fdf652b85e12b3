"""The key names a turn names (~30: acquire's, the commit's, the selected stream's seven),
built once per session key and kept while the session is cached, and once per channel.
Bounded: a full cache starts again, a long key is never kept. ``RedisBus`` is a
``TurnKeys``.
"""

from __future__ import annotations

from bus_redis.keys import Keys, channel_of


class ChannelNames:
    """The key names of one channel that a turn names."""

    __slots__ = ("dead", "leases", "owners", "pulse", "queued", "ready", "sessions_index")

    def __init__(self, k: Keys, c: str) -> None:
        self.leases = k.leases(c)
        self.sessions_index = k.sessions_index(c)
        self.owners = k.owners(c)
        self.dead = k.dead(c)
        self.pulse = k.pulse(c)
        self.ready = k.ready(c)
        self.queued = k.queued(c)


class TurnNames:
    """The key names a turn of session key S names (as S, and as the effective key K)."""

    __slots__ = (
        "attempts", "channel", "inbound", "journal", "lease", "out", "owner", "pending",
        "session", "stream",
    )  # fmt: skip

    def __init__(self, k: Keys, s: str, channel: ChannelNames) -> None:
        self.channel = channel
        self.lease, self.pending, self.session = k.lease(s), k.pending(s), k.session(s)
        self.inbound, self.attempts, self.out = k.inbound(s), k.attempts(s), k.out(s)
        self.owner, self.journal = k.owner(s), k.journal(s)
        # S as a stream to select from: seven KEYS (lua/_common.lua)
        self.stream = (
            self.inbound, self.attempts, k.control_hint(s), self.owner, channel.ready,
            self.lease, channel.queued,
        )  # fmt: skip


# sessions whose key names are kept (a full cache starts again), as many as the session
# cache holds (session_store.manager.SESSION_CACHE_MAX_SIZE); only keys of at most
# NAMED_KEY_CHARS characters: ~1.5 KB an entry for a 20-character key, ~2.7 KB at 128
# (~45 MB at most)
NAMES_CACHED = 16_384
NAMED_KEY_CHARS = 128
CHANNELS_CACHED = 1_024


class TurnKeys:
    """The key-name cache of ``RedisBus`` (which sets the attributes below)."""

    keys: Keys
    _names: dict[str, TurnNames]
    _channels: dict[str, ChannelNames]

    def names(self, session_key: str) -> TurnNames:
        """The key names of ``session_key``, built once per session while it is cached
        (a turn names ~30 keys); bounded: a full cache starts again, a key longer than
        ``NAMED_KEY_CHARS`` is never kept."""
        got = self._names.get(session_key)
        if got is None:
            c = channel_of(session_key)
            channel = self._channels.get(c)
            if channel is None:
                channel = ChannelNames(self.keys, c)
                if len(self._channels) >= CHANNELS_CACHED:
                    self._channels.clear()
                self._channels[c] = channel
            got = TurnNames(self.keys, session_key, channel)
            if len(session_key) <= NAMED_KEY_CHARS:
                if len(self._names) >= NAMES_CACHED:
                    self._names.clear()
                self._names[session_key] = got
        return got
