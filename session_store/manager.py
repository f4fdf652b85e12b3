"""SessionManager: the worker's session cache in front of a SessionStore.

Durable sessions sit in a cache bounded in sessions, in rows and in characters (a few
long sessions, many short ones and a few of huge messages cost alike), valid only while
their version equals the version in Redis (checked by the lease script). Over a bound,
the least recently used session *of the channel holding the most of it* goes
(``Shares``): one channel's flood of new or long chats evicts its own sessions, not
another channel's. Transient sessions are pinned in a separate table: never evicted
while open, never written anywhere; each keeps its newest rows within a row and a
character budget (``trim_transient``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from bus_redis.naming import channel_of
from bus_redis.results import Ahead, Cached
from session_store.models import RECENT_ROWS, Session, SessionPolicy
from session_store.protocol import SessionInfo, SessionStore
from session_store.shares import Shares

SESSION_CACHE_MAX_SIZE = 16_384  # durable sessions cached, at most
SESSION_CACHE_MAX_ROWS = 250_000  # and their rows, at most (~600 B each: ~150 MB)
SESSION_CACHE_MAX_CHARS = 256 << 20  # and the characters of their rows, at most
SCOPE_HINTS_MAX = 65_536  # scopes of sessions seen, kept after their eviction


class SessionManager:
    def __init__(
        self,
        store: SessionStore,
        *,
        cache_size: int = SESSION_CACHE_MAX_SIZE,
        cache_rows: int = SESSION_CACHE_MAX_ROWS,
        cache_chars: int = SESSION_CACHE_MAX_CHARS,
    ) -> None:
        self.store = store
        self._cache: dict[str, Session] = {}
        self._shares = Shares(3)  # each cached session's weights (1, rows, characters)
        self._transient: dict[str, Session] = {}
        self._bounds = (cache_size, cache_rows, cache_chars)
        self._scopes: dict[str, str] = {}  # key -> scope, outlives the cache
        self._scope_shares = Shares(1)

    # --- cache (plain methods: no I/O) -------------------------------------------------
    def get_cached(self, key: str) -> Session | None:
        session = self._transient.get(key)
        if session is not None:
            return session
        session = self._cache.get(key)
        if session is not None:
            self._shares.touch(key)
        return session

    def is_transient(self, key: str) -> bool:
        return key in self._transient

    def transient_keys(self) -> list[str]:
        return list(self._transient)

    def get_or_create_transient(self, key: str, *, disabled_tools: Iterable[str] = ()) -> Session:
        """A private session held only here; a cached session with another policy is replaced
        by a fresh empty one (stored history is never loaded into it)."""
        policy = SessionPolicy(
            persist=False, log_content=False, disabled_tools=frozenset(disabled_tools)
        )
        current = self._transient.get(key)
        if current is not None and current.policy == policy:
            return current
        session = Session(key=key, policy=policy)
        self._drop(key)
        self._transient[key] = session
        return session

    def trim_transient(self, key: str, keep_rows: int, keep_chars: int | None = None) -> None:
        """Keep a private session's newest ``keep_rows`` rows, and of them the newest that
        hold at most ``keep_chars`` characters (``Session.held_chars``), from a user row on:
        its history lives in the worker's memory, which a frontend must not be able to
        fill."""
        session = self._transient.get(key)
        if session is None:
            return
        start = session.first_within(keep_rows, keep_chars)
        if start == 0:
            return
        tail = session.messages[start:]
        first_user = next((i for i, r in enumerate(tail) if r.get("role") == "user"), len(tail))
        self._transient[key] = Session(
            key=key,
            messages=tail[first_user:],
            created_at=session.created_at,
            metadata=session.metadata,
            scope=session.scope,
            born=session.born,
            quota=session.quota,
            policy=session.policy,
        )

    def forget_stored(self) -> None:
        """Forget every copy of a durable session (Redis came back as another server: the
        same versions may hold other rows); private sessions live here only and stay."""
        self._cache.clear()
        self._shares.clear()

    def invalidate(self, key: str) -> None:
        """Forget every copy of ``key`` here: the stored one cached and a private one."""
        self._drop(key)
        self._transient.pop(key, None)

    def invalidate_stored(self, key: str) -> None:
        """Forget the cached copy of the durable session stored under ``key`` (it changed,
        or it is gone); a private session open on the same key is another conversation,
        held only here, and stays."""
        self._drop(key)

    def _drop(self, key: str) -> None:
        self._cache.pop(key, None)
        self._shares.drop(key)

    def _count(self, session: Session) -> None:
        """(Re)count a cached session's weights, as its channel's most recently used."""
        weights = (1, len(session.messages), session.held_chars)
        self._shares.put(channel_of(session.key), session.key, weights)

    def scope_hint(self, key: str) -> str:
        """The scope of a durable session seen before (even if evicted since), or ''."""
        cached = self._cache.get(key)
        if cached is not None and cached.scope:
            return cached.scope
        return self._scopes.get(key, "")

    def _remember(self, session: Session) -> Session:
        key = session.key
        if session.scope and self._scopes.get(key) == session.scope:
            self._scope_shares.touch(key)
        elif session.scope:
            self._scopes[key] = session.scope
            self._scope_shares.put(channel_of(key), key, (1,))
            self._scope_shares.trim(self._scopes, SCOPE_HINTS_MAX, key)
        if self._cache.get(key) is not session:
            self._drop(key)
        self._cache[key] = session
        self._count(session)
        self._evict(key)
        return session

    def _evict(self, keep: str) -> None:
        """While over a bound, the least recently used session of the channel holding
        the most of it goes (``keep``, the session just used, stays)."""
        totals, (sessions, rows, chars) = self._shares.totals, self._bounds
        while totals[0] > sessions or totals[1] > rows or totals[2] > chars:
            over = 0 if totals[0] > sessions else 1 if totals[1] > rows else 2
            victim = self._shares.victim(over, keep)
            if victim is None:
                return
            self._drop(victim)

    # --- storage -------------------------------------------------------------------------
    async def get_or_create(self, key: str) -> Session:
        cached = self.get_cached(key)
        if cached is not None:
            return cached
        return self._remember(await self.store.load(key) or Session(key=key))

    def cached_for_acquire(self, key: str) -> Cached | None:
        """The cached durable copy of ``key`` as acquire compares it (None when there is
        none, or when it holds rows not yet stored)."""
        cached = self._cache.get(key)
        if cached is None or not cached.generation or cached.unpersisted():
            return None
        return self.store.cached(cached)

    async def load_for_turn(
        self, key: str, version: int, generation: str = "", ahead: Ahead | None = None
    ) -> Session:
        """The durable session at ``version`` of hash ``generation`` (both from the lease
        script): the cached object when it is current, caught up when it is behind (with
        ``ahead``, the rows acquire read for it, without a round trip), else a fresh load.
        A session that was deleted and re-created has another generation, so a stale copy
        is never used."""
        cached = self._cache.get(key)
        if (
            cached is not None
            and cached.version == version
            and cached.generation == generation
            and not cached.unpersisted()
        ):
            _trim(cached)
            self._count(cached)  # it grew by the turns committed since
            self._evict(key)
            return cached
        if (  # behind by a few turns (they ran on other workers): read only what it lacks
            cached is not None
            and cached.generation
            and cached.generation == generation
            and cached.version < version
            and not cached.unpersisted()
            and await self.store.load_since(cached, ahead)
            and cached.version == version
        ):
            _trim(cached)
            return self._remember(cached)  # (it may have been evicted while we read)
        loaded = await self.store.load_recent(key) if version else None
        return self._remember(loaded or Session(key=key))

    async def save(self, session: Session) -> None:
        """Write a whole durable session; a no-op for non-persistent (transient) sessions."""
        if not session.policy.persist:
            return
        await self.store.save(session)
        self._remember(session)

    async def read_session(self, key: str, *, last: int | None = None) -> dict[str, Any] | None:
        """The stored payload (with ``last``, its newest ``last`` rows only), or None;
        never touches the cache."""
        return await self.store.read(key, last=last)

    async def read_metadata(self, key: str) -> dict[str, Any] | None:
        return await self.store.read_metadata(key)

    async def update_metadata(self, key: str, updates: dict[str, Any]) -> bool:
        ok = await self.store.update_metadata(key, updates)
        cached = self._cache.get(key)
        if ok and cached is not None:  # (a row count is unchanged by metadata)
            cached.metadata.update(updates)
            cached.version = await self.store.version(key)
        return ok

    async def delete_session(self, key: str) -> bool:
        self.invalidate(key)
        return await self.store.delete(key)

    async def list_sessions(
        self, scope: str | None = None, *, limit: int | None = None
    ) -> list[SessionInfo]:
        """Stored sessions, newest first; with ``scope``, only that scope's; with
        ``limit``, the newest ``limit``."""
        return await self.store.list_sessions(scope, limit=limit)


def _trim(session: Session) -> None:
    """A copy kept between turns holds about what a load for a turn reads (the rows not
    consolidated and the newest ``RECENT_ROWS``), not every row the session ever had:
    the consolidated rows before those go, ``RECENT_ROWS`` or more at a time."""
    cut = min(
        session.last_consolidated, session.persisted_count, len(session.messages) - RECENT_ROWS
    )
    if cut >= RECENT_ROWS:
        session.forget_before(cut)
