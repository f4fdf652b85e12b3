"""How much one user may leave waiting for the workers: at most ``chats`` chats with
entries waiting in their streams, each at most ``per_chat`` of them (two more for a stop,
discard, new or delete, so a full chat can still be stopped).

Without this a user could write into Redis as fast as the gateway accepts requests while
the workers answer at the model's pace (or not at all, when they are down): the queued
messages would grow until Redis' ``maxmemory`` made every write fail, for every channel.
With it, what one user can have queued is at most ``chats x (per_chat + 2)`` entries of
at most ``AGENT_GATEWAY_MAX_BODY_BYTES`` each, on any number of requests.

The count is the streams' length (``XLEN``: what the workers have not consumed yet) of
the chats the user wrote to last (``P:{C}:gw:user:<h>:waiting``; idle ones leave it as they
are seen). A check and the write after it run under a lock per user in this process, so
concurrent requests cannot all pass one check; replicas may overshoot by one chat each.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from redis.asyncio import Redis

from bus_redis.codec import text
from bus_redis.keys import Keys
from gateway.auth import User

CONTROL_ROOM = 2  # entries a control may add past per_chat
LOCKS = 256  # a user's lock is one of these (striped by user hash): bounded memory


class BacklogFullError(Exception):
    """The user has too much waiting: nothing was written (HTTP 429)."""


class Room:
    """What an admitted request wrote to: recorded in the user's waiting set on exit."""

    def __init__(self) -> None:
        self.keys: list[str] = []

    def add(self, session_key: str) -> None:
        self.keys.append(session_key)


class Backlog:
    def __init__(
        self, redis: Redis, keys: Keys, channel: str, *, per_chat: int, chats: int
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.channel = channel
        self.per_chat = per_chat
        self.chats = chats
        self._locks = [asyncio.Lock() for _ in range(LOCKS)]

    @asynccontextmanager
    async def admit(
        self, user: User, session_key: str | None, *, control: bool = False
    ) -> AsyncIterator[Room]:
        """Raise ``BacklogFullError`` when the user may not write to ``session_key`` (None:
        a chat about to be made); else run the block, which writes to it and to the chats
        it ``add``s to the yielded room: all of them are counted from then on."""
        room = Room()
        async with self._locks[int(user.hash[:8], 16) % LOCKS]:
            await self._check(user, session_key, control)
            if session_key is not None:
                room.add(session_key)
            try:
                yield room
            finally:  # (also when the block failed: a chat counted too many is let go
                await self._remember(user, room.keys)  # when it is seen idle)

    async def _check(self, user: User, session_key: str | None, control: bool) -> None:
        waiting = self.keys.gw_waiting(self.channel, user.hash)
        # the newest 2 x chats: replicas' overshoot included, the read stays bounded
        seen = [text(m) for m in await self.redis.zrevrange(waiting, 0, 2 * self.chats)]
        others = [k for k in seen if k != session_key]
        async with self.redis.pipeline(transaction=False) as pipe:
            for key in others:
                pipe.xlen(self.keys.inbound(key))
            if session_key is not None:
                pipe.xlen(self.keys.inbound(session_key))
            lengths = [int(n) for n in await pipe.execute()]
        mine = lengths.pop() if session_key is not None else 0
        idle = [k for k, n in zip(others, lengths, strict=True) if n == 0]
        if idle:
            await self.redis.zrem(waiting, *idle)
        limit = self.per_chat + (CONTROL_ROOM if control else 0)
        if mine >= limit:
            raise BacklogFullError(
                f"{mine} messages are waiting in this chat (at most {self.per_chat}): "
                "wait for the answers, or stop them"
            )
        busy = len(others) - len(idle)
        if mine == 0 and busy >= self.chats:
            raise BacklogFullError(
                f"messages are waiting in {busy} of your chats (at most {self.chats}): "
                "wait for the answers, or stop them"
            )

    async def _remember(self, user: User, session_keys: list[str]) -> None:
        if not session_keys:
            return
        waiting = self.keys.gw_waiting(self.channel, user.hash)
        now_ms = int(time.time() * 1000)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zadd(waiting, dict.fromkeys(session_keys, now_ms))
            pipe.zcard(waiting)
            _, size = await pipe.execute()
        extra = int(size) - (2 * self.chats + 1)
        if extra > 0:  # (replicas' overshoot): the oldest go, the set stays bounded
            await self.redis.zpopmin(waiting, extra)
