"""Shares: a cache's entries grouped by channel, for eviction that is fair across them.

Each entry has weights (e.g. 1 for the session, its rows, its characters); a cache over
one of its bounds evicts the least recently used entry *of the channel that holds the
most of that weight*. One channel writing to many new chats, or a few very long ones,
thus evicts its own entries, never another channel's while it holds more than that
channel. With one channel this is a plain LRU. The pick looks at every channel that
holds an entry (frontends are configured, not made by users: a few to hundreds).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


class Shares:
    """Weights of cached entries, by channel and in least-recently-used order."""

    def __init__(self, weights: int) -> None:
        self.totals = [0] * weights
        self._lru: dict[str, OrderedDict[str, tuple[int, ...]]] = {}  # channel -> key -> w
        self._sums: dict[str, list[int]] = {}  # channel -> its totals
        self._channel: dict[str, str] = {}  # key -> channel

    def __len__(self) -> int:
        return len(self._channel)

    def __contains__(self, key: str) -> bool:
        return key in self._channel

    def put(self, channel: str, key: str, weights: tuple[int, ...]) -> None:
        """Add ``key`` (or update its weights), as the most recently used of its channel."""
        if self._channel.get(key) == channel:  # (every turn: counted again, in place)
            entries, sums = self._lru[channel], self._sums[channel]
            old = entries[key]
            for i, w in enumerate(weights):
                sums[i] += w - old[i]
                self.totals[i] += w - old[i]
            entries[key] = weights
            entries.move_to_end(key)
            return
        self.drop(key)
        self._channel[key] = channel
        self._lru.setdefault(channel, OrderedDict())[key] = weights
        sums = self._sums.setdefault(channel, [0] * len(self.totals))
        for i, w in enumerate(weights):
            sums[i] += w
            self.totals[i] += w

    def touch(self, key: str) -> None:
        channel = self._channel.get(key)
        if channel is not None:
            self._lru[channel].move_to_end(key)

    def drop(self, key: str) -> None:
        channel = self._channel.pop(key, None)
        if channel is None:
            return
        weights = self._lru[channel].pop(key)
        sums = self._sums[channel]
        for i, w in enumerate(weights):
            sums[i] -= w
            self.totals[i] -= w
        if not self._lru[channel]:
            del self._lru[channel], self._sums[channel]

    def clear(self) -> None:
        self.totals = [0] * len(self.totals)
        self._lru.clear()
        self._sums.clear()
        self._channel.clear()

    def trim(self, table: dict[str, Any], bound: int, keep: str) -> None:
        """Evict from ``table`` (the cache these entries weigh, one weight: 1 each) while
        it holds more than ``bound`` entries (``keep`` stays)."""
        while len(table) > bound:
            victim = self.victim(0, keep)
            if victim is None:
                return
            self.drop(victim)
            del table[victim]

    def victim(self, weight: int, keep: str = "") -> str | None:
        """The entry to evict for bound ``weight``: the least recently used of the channel
        holding the most of it (``keep``, the entry just used, never; None: no other)."""
        best, best_sum = None, -1
        for channel, entries in self._lru.items():
            first = next(iter(entries))
            if first == keep and len(entries) == 1:
                continue
            if self._sums[channel][weight] > best_sum:
                best, best_sum = channel, self._sums[channel][weight]
        if best is None:
            return None
        keys = iter(self._lru[best])
        first = next(keys)
        return next(keys) if first == keep else first
