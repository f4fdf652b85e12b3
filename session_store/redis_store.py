"""RedisSessionStore: one hash per durable session, an index sorted set by update time."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Iterable
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import WatchError

from bus_redis.codec import text
from bus_redis.keys import Keys, channel_of, glob_escape
from bus_redis.mux import Multiplexed
from bus_redis.results import Ahead, Cached
from bus_redis.scripts import Scripts
from session_store.codec import (
    apply_meta,
    decode_meta,
    decode_rows,
    decode_session,
    dumps,
    encode_meta,
    encode_rows,
    readable_rows,
)
from session_store.models import RECENT_ROWS, Session
from session_store.protocol import SessionInfo

# the holder names in the leases of operations that run no turn (``_hold``): in the lease
# registry like a turn's, so no worker may take one as its id (the liveness takeover
# would take a live hold for a dead worker's lease; worker.config rejects them)
ADMIN_HOLDER, PRUNE_HOLDER = "admin", "prune"
NON_TURN_HOLDERS = frozenset({ADMIN_HOLDER, PRUNE_HOLDER})

ROWS_AHEAD = 24  # rows read with the head fields when catching up (one round trip): a dozen
# two-row turns that ran on other workers
LOAD_BATCH = 1000  # rows per HMGET of a load: no one command as long as a history
TAIL_ATTEMPTS = 3  # reads of a tool's tail of a session while it is deleted and started again


class SessionBusyError(TimeoutError):
    """A session's lease stayed held (a turn ran) for as long as an operation waited: Redis
    answered all along (no connection trouble, as a bare TimeoutError would suggest)."""


class RedisSessionStore:
    """Durable sessions in Redis. Turn commits go through the fenced
    ``commit`` script instead of :meth:`save`; :meth:`save` is the whole-session write
    for administration and tests (all-or-nothing, in one MULTI)."""

    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        *,
        lock_ttl_ms: int = 10_000,
        fast: Multiplexed | None = None,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.lock_ttl_ms = lock_ttl_ms
        self.fast = fast  # the turn path's pipelined connection (bus_redis.mux), if any
        self._scripts = Scripts(redis, fast)

    async def _hmget(self, hkey: str, fields: list[str]) -> list[Any]:
        if self.fast is not None:
            return list(await self.fast.execute("HMGET", hkey, *fields))
        return list(await self.redis.hmget(hkey, fields))  # type: ignore[misc]

    async def load(self, key: str) -> Session | None:
        raw = await self.redis.hgetall(self.keys.session(key))  # type: ignore[misc]
        return decode_session(key, {text(k): text(v) for k, v in raw.items()})

    async def load_recent(self, key: str, *, keep: int = RECENT_ROWS) -> Session | None:
        """The stored session for a turn: its rows from the first not consolidated (and at
        least the newest ``keep``), the older ones left out (``Session.base``), read
        ``LOAD_BATCH`` at a time: a turn's load costs what it can use, not the length of the
        history (a chat consolidated over months holds every row it ever had). The rows
        are read after the head fields; under the lease no commit lands in between, and a
        rewrite meanwhile (another generation) is caught by whoever commits."""
        hkey = self.keys.session(key)
        meta_raw, count_raw, version, gen = await self._hmget(
            hkey, ["meta", "count", "version", "gen"]
        )
        if meta_raw is None and count_raw is None:
            return None
        meta = decode_meta(text(meta_raw) if meta_raw is not None else None)
        count = int(text(count_raw) or 0) if count_raw is not None else 0
        lc = meta.get("last_consolidated", 0)
        lc = lc if isinstance(lc, int) and not isinstance(lc, bool) and lc >= 0 else 0
        first = max(0, min(lc, count - keep))
        raws: list[Any] = []
        for start in range(first, count, LOAD_BATCH):
            end = min(count, start + LOAD_BATCH)
            raws += await self._hmget(hkey, [f"m:{i}" for i in range(start, end)])
        session = Session(
            key=key, messages=readable_rows(text(r) if r is not None else None for r in raws)
        )
        session.base = first
        apply_meta(session, meta)
        session.skipped_rows = (count - first) - len(session.messages)
        session.mark_persisted(int(text(version) or 0), text(gen) if gen is not None else "")
        return session

    def cached(self, session: Session) -> Cached:
        """How acquire sees ``session`` (a current, persisted copy): it reads the rows the
        copy lacks in the same call when the copy is behind."""
        rows = session.base + session.persisted_count + session.skipped_rows  # rows it has seen
        return Cached(rows, session.generation or "", session.version, ROWS_AHEAD)

    async def load_since(self, cached: Session, ahead: Ahead | None = None) -> bool:
        """Bring ``cached`` (persisted, no pending rows) up to the stored hash by reading only
        what it lacks: the head fields, then the rows appended since (none of it when
        ``ahead``, what acquire read for this copy, holds them). False when that is not
        enough (another generation: re-created or rewritten; fewer rows; an older version):
        the caller loads the whole hash."""
        hkey = self.keys.session(cached.key)
        have = cached.base + cached.persisted_count + cached.skipped_rows  # rows it has seen
        if ahead is None or ahead.start != have:
            fields = ["meta", "count", "version", "gen"]
            fields += [f"m:{i}" for i in range(have, have + ROWS_AHEAD)]  # usually all it lacks
            raw = await self._hmget(hkey, fields)
            meta, count_raw, version, gen = (text(v) if v is not None else "" for v in raw[:4])
            ahead = Ahead(have, int(version or 0), gen, meta, int(count_raw or 0), tuple(raw[4:]))
        count = ahead.count
        if ahead.generation != cached.generation or count < have or ahead.version < cached.version:
            return False
        fresh: list[Any] = list(ahead.rows[: count - have])
        if count > have + len(ahead.rows):  # more turns than that ran elsewhere
            fields = [f"m:{i}" for i in range(have + len(ahead.rows), count)]
            fresh += await self._hmget(hkey, fields)
        rows = decode_rows(text(r) if r is not None else None for r in fresh)
        if rows is None:
            return False  # a row is missing or unreadable: the whole hash decides
        cached.extend_stored(rows)
        apply_meta(
            cached, decode_meta(ahead.meta)
        )  # after: last_consolidated may be past the old end
        cached.mark_persisted(ahead.version, ahead.generation)
        return True

    async def version(self, key: str) -> int:
        return int(text(await self.redis.hget(self.keys.session(key), "version")) or 0)  # type: ignore[misc]

    async def save(self, session: Session) -> None:
        hkey = self.keys.session(session.key)
        rows = encode_rows(session.messages)
        base = session.base  # rows before them (a turn's load left them out) stay as they are
        mapping: dict[str, Any] = {"meta": encode_meta(session), "count": base + len(rows)}
        mapping.update({f"m:{base + i}": row for i, row in enumerate(rows)})
        # a rewrite is a new generation: a copy cached elsewhere reloads the whole hash
        # instead of reading only rows appended since (load_since)
        generation = secrets.token_hex(8)
        async with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(hkey)
                    old_count = int(text(await pipe.hget(hkey, "count")) or 0)  # type: ignore[misc]
                    pipe.multi()
                    pipe.hset(hkey, mapping={**mapping, "gen": generation})
                    stale = [f"m:{i}" for i in range(base + len(rows), old_count)]
                    if stale:
                        pipe.hdel(hkey, *stale)
                    pipe.hincrby(hkey, "version", 1)
                    now = int(time.time() * 1000)
                    pipe.zadd(self.keys.sessions_index(channel_of(session.key)), {session.key: now})
                    if session.scope:
                        pipe.zadd(self.keys.scope_sessions(session.scope), {session.key: now})
                    result = await pipe.execute()
                    break
                except WatchError:
                    continue
        version_at = -2 if session.scope else -1
        session.mark_persisted(int(result[version_at - 1]), generation)
        session.skipped_rows = 0  # every row of the rewritten hash is one of its messages

    async def delete(self, key: str, *, timeout_s: float = 30.0) -> bool:
        """Delete a stored session under its lease: a running turn finishes (and commits)
        first, and cannot re-create the hash afterwards from a stale copy."""
        token = f"{secrets.token_hex(8)}|{ADMIN_HOLDER}"
        lease = self.keys.lease(key)
        deadline = time.monotonic() + timeout_s
        delay_s = 0.01
        while not await self._hold(key, lease, token):
            if time.monotonic() > deadline:
                raise SessionBusyError(f"session {key!r} stayed busy for {timeout_s:.0f}s")
            await asyncio.sleep(delay_s)  # back off while a turn holds the lease
            delay_s = min(delay_s * 2, 0.5)
        try:
            deleted = await self.delete_held(key, lease, token)
        finally:
            release = self.keys.release(key, lease)
            await self._scripts.call("release", release, [token, key, 1_000_000])
        return deleted > 0

    async def _hold(self, key: str, lease: str, token: str) -> bool:
        """Take K's lease for an operation that runs no turn (``lua/hold.lua``)."""
        keys = [lease, self.keys.leases(channel_of(key))]
        return bool(int(await self._scripts.call("hold", keys, [token, self.lock_ttl_ms, key])))

    async def prune_idle(
        self,
        channel: str,
        older_than_ms: int,
        *,
        limit: int = 100,
        schedules_of: Iterable[str] = (),
    ) -> list[str]:
        """Delete up to ``limit`` of the channel's stored sessions not updated for
        ``older_than_ms`` (hash, index entries, events), each under its lease: a session
        whose lease is taken, or with messages queued, is not idle and is left alone, nor
        is one with schedules. ``schedules_of``: channels whose schedules all count as
        the session's (the unified session's: every chat's firings are its turns).
        Returns the deleted keys."""
        held_by = [self.keys.cron_due(c) for c in sorted(set(schedules_of))]
        seconds, micros = await self.redis.time()
        cutoff = int(seconds) * 1000 + int(micros) // 1000 - older_than_ms
        index = self.keys.sessions_index(channel)
        deleted: list[str] = []
        for raw in await self.redis.zrangebyscore(index, "-inf", cutoff, start=0, num=limit):
            key = text(raw)
            token = f"{secrets.token_hex(8)}|{PRUNE_HOLDER}"
            lease = self.keys.lease(key)
            if not await self._hold(key, lease, token):
                continue  # a turn runs: not idle
            try:
                score = await self.redis.zscore(index, key)
                queued = await self.redis.exists(self.keys.inbound(key))
                kept_by = (self.keys.crons(key), self.keys.owner(key), *held_by)
                if await self.redis.exists(*kept_by):
                    # it has schedules (a yearly one, an `at` months ahead), or a private
                    # session is open on its key (whose events its stream holds now):
                    # kept, and looked at again after another idle period, not every pass
                    await self.redis.zadd(index, {key: cutoff + older_than_ms}, xx=True)
                    continue
                # updated meanwhile, or its next turn is on its way: not idle. Otherwise
                # delete.lua removes the hash and its index entries (also an entry left
                # without a hash)
                idle = score is not None and score <= cutoff and not queued
                if idle and await self.delete_held(key, lease, token) > 0:
                    deleted.append(key)
            finally:
                release = self.keys.release(key, lease)
                await self._scripts.call("release", release, [token, key, 1_000_000])
        return deleted

    async def delete_held(
        self, key: str, lease: str, token: str, *, events_before: str = ""
    ) -> int:
        """Delete session ``key`` (hash, index entries, events) if ``lease`` still holds
        ``token``: 1 deleted, 0 nothing stored, -1 the lease was lost. With
        ``events_before`` (a delete or new marker's id) the error answers written from its
        millisecond on stay (the cancelled answers of what it covered), no other event."""
        meta = decode_meta(text(await self.redis.hget(self.keys.session(key), "meta")))  # type: ignore[misc]
        keys = self.keys.deletion(key, lease, str(meta.get("scope") or ""))
        return int(text(await self._scripts.call("delete", keys, [token, key, events_before])))

    async def read(self, key: str, *, last: int | None = None) -> dict[str, Any] | None:
        """The stored session as a document; with ``last``, only its newest ``last`` rows
        are read (a tool's read costs what it returns, not the session's length)."""
        session = await self.load(key) if last is None else await self._load_tail(key, last)
        if session is None:
            return None
        return {
            "key": key,
            "created_at": session.created_at,
            "updated_at": session.updated_at,
            "metadata": session.metadata,
            "scope": session.scope,
            "messages": session.messages,
        }

    async def _load_tail(self, key: str, last: int) -> Session | None:
        """The newest ``last`` rows, read without the lease in two round trips: the rows
        come with the session's generation again, and a session deleted and started anew
        in between (maybe by a sender of another scope) is read again, so that the rows
        returned are those of the meta (the scope) returned."""
        hkey = self.keys.session(key)
        for _ in range(TAIL_ATTEMPTS):
            meta, count, gen = await self._hmget(hkey, ["meta", "count", "gen"])
            if meta is None and count is None:
                return None
            n = int(text(count) or 0) if count is not None else 0
            first = max(0, n - max(0, last))
            if n <= first:
                raws: list[Any] = []
            else:
                *raws, gen_after = await self._hmget(
                    hkey, [*(f"m:{i}" for i in range(first, n)), "gen"]
                )
                if gen_after != gen:
                    continue  # another session under this key now: read it from its start
            session = Session(key=key, messages=readable_rows(text(r) for r in raws))
            apply_meta(session, decode_meta(text(meta) if meta is not None else None))
            return session
        return None  # deleted and started again each time: nothing to be sure of

    async def read_metadata(self, key: str) -> dict[str, Any] | None:
        raw = await self.redis.hget(self.keys.session(key), "meta")  # type: ignore[misc]
        if raw is None:
            return None
        meta = decode_meta(text(raw))
        return {k: meta.get(k) for k in ("key", "created_at", "updated_at", "metadata")}

    async def update_metadata(self, key: str, updates: dict[str, Any]) -> bool:
        """Merge ``updates`` into the metadata atomically (WATCH/MULTI), history untouched."""
        hkey = self.keys.session(key)
        async with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(hkey)
                    raw = await pipe.hget(hkey, "meta")  # type: ignore[misc]
                    if raw is None:
                        return False
                    meta = decode_meta(text(raw))
                    meta["metadata"] = {**(meta.get("metadata") or {}), **updates}
                    pipe.multi()
                    pipe.hset(hkey, "meta", dumps(meta))
                    pipe.hincrby(hkey, "version", 1)
                    await pipe.execute()
                    return True
                except WatchError:
                    continue

    async def _indexes(self) -> list[str]:
        pattern = f"{glob_escape(self.keys.prefix)}:{{*}}:sessions"
        return [text(k) async for k in self.redis.scan_iter(match=pattern, _type="zset")]

    async def list_sessions(
        self, scope: str | None = None, *, limit: int | None = None
    ) -> list[SessionInfo]:
        """Stored sessions: of every channel newest first, or of one scope (newest
        created first: a scope's index is written once per session, not per turn); with
        ``limit``, the newest ``limit`` only (each index is read that far, no further)."""
        if limit is not None and limit < 1:
            return []
        indexes = [self.keys.scope_sessions(scope)] if scope else await self._indexes()
        stop = -1 if limit is None else limit - 1
        scored: dict[str, float] = {}
        for index in indexes:
            for k, score in await self.redis.zrevrange(index, 0, stop, withscores=True):
                scored[text(k)] = float(score)
        keys = sorted(scored, key=lambda k: -scored[k])[:limit]
        async with self.redis.pipeline(transaction=False) as pipe:
            for k in keys:
                pipe.hmget(self.keys.session(k), ["meta", "count"])
            rows = await pipe.execute()
        out: list[SessionInfo] = []
        for k, (meta_raw, count) in zip(keys, rows, strict=True):
            meta = decode_meta(text(meta_raw))
            md = meta.get("metadata") or {}
            out.append(
                SessionInfo(
                    key=k,
                    scope=str(meta.get("scope") or ""),
                    created_at=str(meta.get("created_at", "")),
                    updated_at=str(meta.get("updated_at", "")),
                    title=str(md.get("title", "")) if isinstance(md, dict) else "",
                    messages=int(text(count) or 0),
                )
            )
        return out
