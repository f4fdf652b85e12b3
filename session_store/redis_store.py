"""RedisSessionStore: one hash per durable session, an index sorted set by update time."""

from __future__ import annotations

import time
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import WatchError

from bus_redis.codec import text
from bus_redis.keys import Keys
from session_store.codec import decode_meta, decode_session, dumps, encode_meta, encode_rows
from session_store.models import Session
from session_store.protocol import SessionInfo


class RedisSessionStore:
    """Durable sessions in Redis (SPEC 4). Turn commits go through the fenced
    ``commit`` script instead of :meth:`save`; :meth:`save` is the whole-session write
    for administration and tests (all-or-nothing, in one MULTI)."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys

    async def load(self, key: str) -> Session | None:
        raw = await self.redis.hgetall(self.keys.session(key))  # type: ignore[misc]
        return decode_session(key, {text(k): text(v) for k, v in raw.items()})

    async def version(self, key: str) -> int:
        return int(text(await self.redis.hget(self.keys.session(key), "version")) or 0)  # type: ignore[misc]

    async def save(self, session: Session) -> None:
        hkey = self.keys.session(session.key)
        rows = encode_rows(session.messages)
        mapping: dict[str, Any] = {"meta": encode_meta(session), "count": len(rows)}
        mapping.update({f"m:{i}": row for i, row in enumerate(rows)})
        async with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(hkey)
                    old_count = int(text(await pipe.hget(hkey, "count")) or 0)  # type: ignore[misc]
                    pipe.multi()
                    pipe.hset(hkey, mapping=mapping)
                    stale = [f"m:{i}" for i in range(len(rows), old_count)]
                    if stale:
                        pipe.hdel(hkey, *stale)
                    pipe.hincrby(hkey, "version", 1)
                    pipe.zadd(self.keys.sessions_index, {session.key: int(time.time() * 1000)})
                    result = await pipe.execute()
                    break
                except WatchError:
                    continue
        session.mark_persisted(int(result[-2]))

    async def delete(self, key: str) -> bool:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self.keys.session(key))
            pipe.zrem(self.keys.sessions_index, key)
            deleted, _ = await pipe.execute()
        return bool(deleted)

    async def read(self, key: str) -> dict[str, Any] | None:
        session = await self.load(key)
        if session is None:
            return None
        return {
            "key": key,
            "created_at": session.created_at,
            "updated_at": session.updated_at,
            "metadata": session.metadata,
            "messages": session.messages,
        }

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

    async def list_sessions(self) -> list[SessionInfo]:
        keys = [text(k) for k in await self.redis.zrevrange(self.keys.sessions_index, 0, -1)]
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
                    created_at=str(meta.get("created_at", "")),
                    updated_at=str(meta.get("updated_at", "")),
                    title=str(md.get("title", "")) if isinstance(md, dict) else "",
                    messages=int(text(count) or 0),
                )
            )
        return out
