"""A user's chats: server-minted ids, ownership, status and history.

A chat id is ``<user hash>-<random>`` (durable), ``<user hash>-t-<random>`` (temporary,
a private session) or ``<user hash>-oa-<digest>`` (the OpenAI-compatible endpoint); its
session key is ``<channel>:<chat id>``. A chat belongs to the user whose hash starts its
id, and a durable one only while it is in that user's index (``P:{C}:gw:user:<h>:sessions``),
so a deleted chat is gone for its owner too. Nothing of a chat's text is kept here: history
is read from the session hash the workers write.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import WatchError

from bus_redis.codec import text
from bus_redis.keys import Keys
from gateway.auth import User

DROP_BATCH = 16  # expired chats checked again and dropped per call (each: 3 round trips)
CHAT_ID_RE = re.compile(r"(?P<user>[0-9a-f]{24})-(?P<kind>t-|oa-)?[0-9a-f]{16,32}")
TITLE_MAX = 80
# a history read answers at most this many characters of stored rows (older rows left out)
HISTORY_MAX_CHARS = 2 << 20
HISTORY_BATCH = 20


def end_user_digest(end_user: str | None) -> str:
    """The OpenAI endpoint's chat of a bot's end user (its ``user`` field) is
    ``<user hash>-oa-<this>``."""
    return hashlib.sha256(f"openai|{end_user or ''}".encode()).hexdigest()[:24]


NO_END_USER = end_user_digest(None)


def end_user_of(chat_id: str) -> str | None:
    """The digest of the bot's end user whose chat ``chat_id`` is (the OpenAI endpoint's
    ``user``), None for any other chat: each end user is a scope of its own (memory,
    session tools), whatever route a message of the chat comes by."""
    m = CHAT_ID_RE.fullmatch(chat_id)
    if m is None or m["kind"] != "oa-":
        return None
    digest = chat_id.rsplit("-", 1)[1]
    return None if digest == NO_END_USER else digest


class ChatLimitError(Exception):
    """The user has ``max_sessions_per_user`` chats already."""


@dataclass(slots=True)
class Chat:
    id: str
    session_key: str
    temporary: bool
    title: str = ""
    created_ms: int = 0

    def public(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "temporary": self.temporary,
            "title": self.title,
            "created_at_ms": self.created_ms,
        }


class Chats:
    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        channel: str,
        *,
        max_per_user: int,
        max_temporary: int,
        expire_after_ms: int = 0,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.channel = channel
        self.max_per_user = max_per_user
        self.max_temporary = max_temporary
        self.expire_after_ms = expire_after_ms  # 0: chats stay listed for ever

    def _index(self, user: User) -> str:
        return self.keys.gw_sessions(self.channel, user.hash)

    def _titles(self, user: User) -> str:
        return self.keys.gw_titles(self.channel, user.hash)

    def _temporary(self, user: User) -> str:
        return self.keys.gw_temporary(self.channel, user.hash)

    def _chat(self, chat_id: str, title: str = "", created_ms: int = 0) -> Chat:
        kind = CHAT_ID_RE.fullmatch(chat_id)
        temporary = bool(kind and kind.group("kind") == "t-")
        return Chat(chat_id, f"{self.channel}:{chat_id}", temporary, title, created_ms)

    async def create(self, user: User, *, title: str = "") -> Chat:
        """A new durable chat (more than ``max_per_user``: ``ChatLimitError``)."""
        chat_id = f"{user.hash}-{secrets.token_hex(12)}"
        return await self._register(user, chat_id, title[:TITLE_MAX])

    def mint_temporary(self, user: User) -> Chat:
        """A new temporary chat's id: registered by its opening (``gateway.backlog``)."""
        return self._chat(f"{user.hash}-t-{secrets.token_hex(12)}")

    async def ensure(self, user: User, chat_id: str) -> Chat:
        """Register a deterministic chat id (OpenAI-compatible endpoint) if it is new."""
        score = await self.redis.zscore(self._index(user), chat_id)
        if score is not None:
            return self._chat(chat_id, created_ms=int(score))
        return await self._register(user, chat_id, "")

    async def _register(self, user: User, chat_id: str, title: str) -> Chat:
        """Added and counted in one transaction: concurrent creations never overshoot."""
        now = int(time.time() * 1000)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.zadd(self._index(user), {chat_id: now}, nx=True)
            pipe.zcard(self._index(user))
            added, count = await pipe.execute()
        if added and count > self.max_per_user and not await self.drop_expired(user):
            await self.redis.zrem(self._index(user), chat_id)
            raise ChatLimitError(f"at most {self.max_per_user} chats per user")
        if title:
            await self.redis.hset(self._titles(user), chat_id, title)  # type: ignore[misc]
        return self._chat(chat_id, title, now)

    async def owned(self, user: User, chat_id: str) -> Chat | None:
        """The chat if ``user`` owns it (else None: answered exactly like a missing one)."""
        match = CHAT_ID_RE.fullmatch(chat_id)
        if match is None or match.group("user") != user.hash:
            return None
        if match.group("kind") == "t-":  # only while the gateway opened it and it is open
            if await self.redis.zscore(self._temporary(user), chat_id) is None:
                return None
            return self._chat(chat_id)
        score = await self.redis.zscore(self._index(user), chat_id)
        if score is None:
            return None
        title = await self.redis.hget(self._titles(user), chat_id)  # type: ignore[misc]
        return self._chat(chat_id, text(title) or "", int(score))

    async def drop_expired(self, user: User) -> int:
        """Chats created over ``expire_after_ms`` ago whose session is not stored (the
        workers deleted it after its idle time, or it was never used) leave the list,
        unless something is waiting in their stream or they have events (a first message
        queued or being answered: its session is about to be stored). At most
        ``max_per_user`` looked at in one pipelined round trip; at most ``DROP_BATCH`` of
        them checked again under WATCH and dropped in one transaction, so a message sent
        meanwhile keeps its chat."""
        if not self.expire_after_ms:
            return 0
        cutoff = int(time.time() * 1000) - self.expire_after_ms
        old = [text(m) for m in await self.redis.zrangebyscore(
            self._index(user), "-inf", cutoff, start=0, num=self.max_per_user
        )]  # fmt: skip
        if not old:
            return 0
        async with self.redis.pipeline(transaction=False) as pipe:
            for chat_id in old:
                self._queue_use(pipe, chat_id)
            uses = await pipe.execute()
        unused = [c for i, c in enumerate(old) if not _used(uses[3 * i : 3 * i + 3])]
        if not unused:
            return 0
        unused = unused[:DROP_BATCH]
        inbound = [self.keys.inbound(f"{self.channel}:{c}") for c in unused]
        async with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:  # a send or a worker's commit meanwhile changes a stream: again
                    await pipe.watch(self._index(user), *inbound)
                    gone = []
                    for chat_id in unused:  # on the watching connection (no second one)
                        if not await in_use(pipe, self.keys, f"{self.channel}:{chat_id}"):
                            gone.append(chat_id)
                    if not gone:
                        return 0
                    pipe.multi()
                    pipe.zrem(self._index(user), *gone)
                    pipe.hdel(self._titles(user), *gone)
                    await pipe.execute()
                    return len(gone)
                except WatchError:
                    continue

    def _queue_use(self, pipe: Any, chat_id: str) -> None:
        for command in _use_reads(self.keys, f"{self.channel}:{chat_id}"):
            pipe.execute_command(*command)

    async def list_for(self, user: User) -> list[Chat]:
        await self.drop_expired(user)
        rows = await self.redis.zrevrange(
            self._index(user), 0, self.max_per_user - 1, withscores=True
        )
        ids = [text(m) for m, _s in rows]
        titles = await self.redis.hmget(self._titles(user), ids) if ids else []  # type: ignore[misc]
        return [
            self._chat(i, text(t) or "", int(s))
            for (i, (_m, s), t) in zip(ids, rows, titles, strict=True)
        ]

    async def forget(self, user: User, chat: Chat) -> None:
        if chat.temporary:
            await self.redis.zrem(self._temporary(user), chat.id)
            return
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.zrem(self._index(user), chat.id)
            pipe.hdel(self._titles(user), chat.id)
            await pipe.execute()

    def title_for(self, chat: Chat, content: str) -> str:
        """The title a message gives its chat: a durable chat without one takes the first
        line of its first message (set with the message, by ``Gateway.publish``)."""
        if chat.temporary or chat.title or not content.strip():
            return ""
        return content.strip().splitlines()[0][:TITLE_MAX]

    async def status(self, chat: Chat) -> dict[str, Any]:
        """``state`` running/idle, ``queued`` messages waiting behind the running one,
        ``messages`` stored, ``last_event_id`` (a resume cursor)."""
        k, s = self.keys, chat.session_key
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xlen(k.inbound(s))
            pipe.exists(k.lease(s))
            pipe.hget(k.session(s), "count")
            pipe.xrevrange(k.out(s), "+", "-", count=1)
            # a wrong-typed key answers an error object in its place, read as "nothing"
            waiting, running, count, last = await pipe.execute(raise_on_error=False)
        waiting = waiting if isinstance(waiting, int) else 0
        running = bool(running) if isinstance(running, int) else False
        last_id = text(last[0][0]) if isinstance(last, list) and last else "0-0"
        return {
            **chat.public(),
            "state": "running" if running else "idle",
            "queued": max(0, waiting - 1) if running else waiting,
            "messages": int(text(count) or 0) if not isinstance(count, Exception) else 0,
            "last_event_id": last_id,
        }

    async def history(self, chat: Chat, limit: int) -> tuple[list[dict[str, Any]], str]:
        """The newest ``limit`` rows of a durable chat: user and assistant text only (tool
        rows and tool calls are the model's working, not the conversation), and no more
        than ``HISTORY_MAX_CHARS`` of them (older rows are left out): rows are read
        newest first, ``HISTORY_BATCH`` at a time, so a read costs Redis and the gateway
        what it answers, however long the rows a user sent. With them, the events
        stream's last id as of those rows: the row count and that id are read in one
        transaction, and a turn's commit writes its rows and its terminal event at once."""
        hkey = self.keys.session(chat.session_key)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hget(hkey, "count")
            pipe.xrevrange(self.keys.out(chat.session_key), "+", "-", count=1)
            counted, last = await pipe.execute(raise_on_error=False)
        cursor = text(last[0][0]) if isinstance(last, list) and last else "0-0"
        if chat.temporary:
            return [], cursor  # a private session's text lives only in its worker's memory
        try:
            count = int(text(counted) or 0) if not isinstance(counted, Exception) else 0
        except ValueError:
            count = 0
        first, raw, size = max(0, count - limit), [], 0
        end = count
        while end > first and size <= HISTORY_MAX_CHARS:
            start = max(first, end - HISTORY_BATCH)
            batch = await self.redis.hmget(hkey, [f"m:{i}" for i in range(start, end)])  # type: ignore[misc]
            for item in reversed(batch):
                size += len(text(item) or "")
                if size > HISTORY_MAX_CHARS:
                    break
                raw.append(item)
            end = start
        raw.reverse()
        out = []
        for item in raw:
            try:
                row = json.loads(text(item) or "null")
            except ValueError:
                continue
            if not isinstance(row, dict) or row.get("role") not in ("user", "assistant"):
                continue
            content = row.get("content")
            if not isinstance(content, str) or not content:
                continue
            out.append({"role": row["role"], "content": content, "timestamp": row.get("timestamp")})
        return out, cursor


def _use_reads(keys: Keys, session_key: str) -> list[tuple[str, ...]]:
    """What tells whether a chat is in use: entries waiting, a stored session, events."""
    return [
        ("XLEN", keys.inbound(session_key)),
        ("HGET", keys.session(session_key), "count"),
        ("TYPE", keys.out(session_key)),
    ]


def _used(replies: list[Any]) -> bool:
    waiting, count, events = replies
    return bool(int(waiting)) or count is not None or text(events) != "none"


async def in_use(pipe: Any, keys: Keys, session_key: str) -> bool:
    """Whether a chat is in use, read on ``pipe`` (one by one: under its WATCH, a change
    after the read aborts the caller's ``EXEC``)."""
    return _used([await pipe.execute_command(*c) for c in _use_reads(keys, session_key)])
