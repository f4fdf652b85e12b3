"""JournalStore: the Redis side of a turn's tool journal (``worker.runtime.journal`` decides
what goes in it). One hash per effective key K, since one turn runs under K's lease at a
time; written only by ``lua/journal.lua``, fenced by that lease; dropped by the commit.
"""

from __future__ import annotations

from collections.abc import Sequence

from bus_redis.codec import text
from bus_redis.streams import RedisBus

JOURNAL_TTL_MS = 86_400_000  # a tool journal outlives any redelivery of its entry


class JournalStore:
    def __init__(self, bus: RedisBus) -> None:
        self.bus = bus
        self.keys = bus.keys

    async def append(self, key: str, token: str, entry: str, rows: Sequence[str]) -> int:
        """Append ``rows`` to the tool journal of ``entry`` running under the lease of
        ``key`` (none: drop it); -1 when the lease is lost (see ``lua/journal.lua``)."""
        keys = [self.keys.lease(key), self.keys.journal(key)]
        args = [token, entry, JOURNAL_TTL_MS, *rows]
        return int(text(await self.bus.scripts.call("journal", keys, args)))

    async def read(self, key: str, entry: str) -> list[str]:
        """The journaled rows of ``entry`` (a lost attempt's), in order; [] when none."""
        raw = await self.bus.raw.hgetall(self.keys.journal(key))  # type: ignore[misc]
        doc = {text(k): text(v) for k, v in raw.items()}
        if doc.get("entry") != entry:
            return []
        n = int(doc.get("n") or 0)
        return [doc[str(i)] for i in range(1, n + 1) if str(i) in doc]

    async def drop_of(self, key: str, token: str, session: str) -> None:
        """Drop the journal under ``key``'s lease when it is of an entry of ``session`` (a
        chat folded into the unified session, deleted or discarded while the journal of
        its crashed turn waited: its entry is cancelled, never re-run)."""
        held = text(await self.bus.raw.hget(self.keys.journal(key), "entry"))  # type: ignore[misc]
        if held.rpartition("|")[0] == session:  # (entry ids hold no '|'; keys may)
            await self.append(key, token, held, ())
