"""How much one user may leave waiting for the workers, whatever their pace.

Per user: at most ``chats`` chats with entries waiting in their streams, each with at most
``per_chat`` entries. A stop, discard, new or delete, and opening a temporary chat (with
the discard of the oldest one it evicts), may use ``CONTROL_ROOM`` more of both, so a
full chat can still be stopped; a delete of a chat never used writes nothing and is never
refused. So what one user can have queued in Redis is at most ``(chats + 2) x
(per_chat + 2)`` entries (one more in a temporary chat evicted while full: its discard) of
at most one request body each, on any number of requests and replicas, while nothing is
consumed.

Without this a user could write into Redis as fast as the gateway accepts requests while
the workers answer at the model's pace (or not at all, when they are down): the queued
messages would grow until Redis' ``maxmemory`` made every write fail, for every channel.

The count is exact across replicas: each write is a ``Guard`` of the transaction that
publishes it (``bus_redis.client``). Under WATCH of the chat's stream, of the user's
``P:{C}:gw:user:<h>:waiting`` (the chats the user wrote to last) and of the list that
makes the chat the user's, it checks that the chat is still the user's, reads the
stream lengths (``XLEN``: what the workers have not consumed yet), and adds the chat to
the waiting set (idle ones leave it) in the same ``MULTI``. A lock per user in each process
keeps one user's concurrent requests from retrying each other's transactions.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import WatchError

from bus_redis.client import FrontendClient, Reader
from bus_redis.codec import text
from bus_redis.keys import Keys
from gateway.auth import User
from gateway.chats import Chat, in_use

CONTROL_ROOM = 2  # entries (and chats) a control or a temporary chat's opening may add
LOCKS = 256  # a user's lock is one of these (striped by user hash): bounded memory


class BacklogFullError(Exception):
    """The user has too much waiting: nothing was written (HTTP 429)."""


class TooLargeError(Exception):
    """The message as published is over the workers' payload limit: nothing was written
    (HTTP 413; a worker would have answered ``too_large`` and dead-lettered it)."""


class ChatGoneError(Exception):
    """The chat left its user's lists before the write (deleted meanwhile): HTTP 404."""


class Backlog:
    def __init__(
        self,
        redis: Redis,
        client: FrontendClient,
        keys: Keys,
        channel: str,
        *,
        per_chat: int,
        chats: int,
    ) -> None:
        self.redis = redis
        self.client = client
        self.keys = keys
        self.channel = channel
        self.per_chat = per_chat
        self.chats = chats
        self._locks = [asyncio.Lock() for _ in range(LOCKS)]
        # how many of the chats written to last a check reads: more than can have entries
        # waiting (chats + 2), with room for the ones written to since (idle ones leave)
        self.window = 2 * (chats + CONTROL_ROOM) + 1

    @asynccontextmanager
    async def serialized(self, user: User) -> AsyncIterator[None]:
        """One of the user's writes at a time in this process."""
        async with self._locks[int(user.hash[:8], 16) % LOCKS]:
            yield

    def guard(
        self,
        user: User,
        chat: Chat,
        *,
        control: bool = False,
        title: str = "",
        forget: bool = False,
    ) -> Admission:
        """The guard of a write to ``chat`` (refused past the bounds, or when the chat is
        no longer the user's); ``title``: set as the chat's title if it has none;
        ``forget``: the chat leaves the user's lists with the write (a delete or discard:
        no message can be admitted after it)."""
        listed = self.keys.gw_temporary if chat.temporary else self.keys.gw_sessions
        return Admission(
            self,
            user,
            chat.session_key,
            listed=(listed(self.channel, user.hash), chat.id),
            titles=self.keys.gw_titles(self.channel, user.hash),
            control=control,
            title=title,
            forget=forget,
        )

    def opening(self, user: User, chat: Chat, max_temporary: int) -> Opening:
        """The guard of a temporary chat's opening: the chat is registered, and the user's
        oldest ones past ``max_temporary`` evicted (their discards written), in the same
        transaction; checked as a control, the evicted chats counted."""
        return Opening(self, user, chat, max_temporary)

    async def forget_unused(self, user: User, chat: Chat) -> bool:
        """A durable chat never used (nothing in its stream, no stored session, no events)
        leaves the user's lists without a marker: True. False when it was used (a delete
        marker must follow). Raises ``ChatGoneError`` when it is not listed any more."""
        s, keys = chat.session_key, self.keys
        index = keys.gw_sessions(self.channel, user.hash)
        async with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:  # a worker's commit changes the stream: the check runs again
                    await pipe.watch(keys.inbound(s), index)
                    if await pipe.zscore(index, chat.id) is None:
                        raise ChatGoneError(s)
                    if await in_use(pipe, keys, s):
                        return False
                    pipe.multi()
                    pipe.zrem(index, chat.id)
                    pipe.hdel(keys.gw_titles(self.channel, user.hash), chat.id)
                    await pipe.execute()
                    return True
                except WatchError:
                    continue

    def _too_many_chats(self, busy: int) -> str:
        return (
            f"messages are waiting in {busy} of your chats (at most {self.chats}): "
            "wait for the answers, or stop them"
        )


class Admission:
    """A ``bus_redis.client.Guard``: one write's checks and bookkeeping."""

    def __init__(
        self,
        backlog: Backlog,
        user: User,
        session_key: str,
        *,
        listed: tuple[str, str] | None = None,
        titles: str = "",
        control: bool = False,
        title: str = "",
        forget: bool = False,
    ) -> None:
        self.backlog = backlog
        self.session_key = session_key
        self.waiting = backlog.keys.gw_waiting(backlog.channel, user.hash)
        self.listed = listed
        self.titles = titles
        self.control = control
        self.title = title
        self.forget = forget
        self.watch = [self.waiting, *([listed[0]] if listed else [])]
        self._idle: list[str] = []

    def reads(self) -> list[tuple[Any, ...]]:
        commands: list[tuple[Any, ...]] = [("ZREVRANGE", self.waiting, 0, self.backlog.window - 1)]
        if self.listed is not None:
            commands.append(("ZSCORE", *self.listed))
        return commands

    async def check(self, replies: list[Any], waiting: int, adding: int, read: Reader) -> None:
        b = self.backlog
        if self.listed is not None and replies[1] is None:
            raise ChatGoneError(self.session_key)
        others = [k for k in (text(m) for m in replies[0]) if k != self.session_key]
        # not watched: a chat drained meanwhile only counts less
        lengths = [int(n) for n in await read([("XLEN", b.keys.inbound(k)) for k in others])]
        self._idle = [k for k, n in zip(others, lengths, strict=True) if n == 0]
        room = CONTROL_ROOM if self.control else 0
        if waiting + adding > b.per_chat + room:
            raise BacklogFullError(
                f"{waiting} messages are waiting in this chat (at most {b.per_chat}): "
                "wait for the answers, or stop them"
            )
        busy = len(others) - len(self._idle)
        if waiting == 0 and busy + 1 > b.chats + room:
            raise BacklogFullError(b._too_many_chats(busy))

    def queue(self, pipe: Any) -> None:
        if self._idle:
            pipe.zrem(self.waiting, *self._idle)
        pipe.zadd(self.waiting, {self.session_key: int(time.time() * 1000)})
        # the newest ``window`` are all a check reads: older ones go
        pipe.zremrangebyrank(self.waiting, 0, -(self.backlog.window + 1))
        if self.listed is None:
            return
        key, chat_id = self.listed
        if self.title:
            pipe.hsetnx(self.titles, chat_id, self.title)
        if self.forget:
            pipe.zrem(key, chat_id)
            pipe.hdel(self.titles, chat_id)


class Opening(Admission):
    """A temporary chat's opening: registered, and the oldest past the limit evicted
    (their discards queued here, announced by the caller: ``evicted``), in one MULTI."""

    def __init__(self, backlog: Backlog, user: User, chat: Chat, max_temporary: int) -> None:
        super().__init__(backlog, user, chat.session_key, control=True)
        self.chat = chat
        self.temporary = backlog.keys.gw_temporary(backlog.channel, user.hash)
        self.max_temporary = max_temporary
        self.watch = [self.waiting, self.temporary]
        self.evicted: list[str] = []  # their session keys

    def reads(self) -> list[tuple[Any, ...]]:
        return [*super().reads(), ("ZRANGEBYSCORE", self.temporary, "-inf", "+inf")]  # oldest first

    async def check(self, replies: list[Any], waiting: int, adding: int, read: Reader) -> None:
        b = self.backlog
        opened = [text(m) for m in replies[-1]]
        over = max(0, len(opened) + 1 - self.max_temporary)
        self.evicted = [f"{b.channel}:{chat_id}" for chat_id in opened[:over]]
        others = [k for k in (text(m) for m in replies[0]) if k != self.session_key]
        rest = [k for k in self.evicted if k not in others]
        lengths = [int(n) for n in await read([("XLEN", b.keys.inbound(k)) for k in others + rest])]
        self._idle = [k for k, n in zip(others, lengths, strict=False) if n == 0]
        busy = sum(1 for n in lengths[: len(others)] if n)
        idle_evicted = sum(
            1 for k, n in zip(others + rest, lengths, strict=True) if k in self.evicted and n == 0
        )
        if busy + 1 + idle_evicted > b.chats + CONTROL_ROOM:
            raise BacklogFullError(b._too_many_chats(busy))

    def queue(self, pipe: Any) -> None:
        super().queue(pipe)
        pipe.zadd(self.temporary, {self.chat.id: int(time.time() * 1000)})
        if not self.evicted:
            return
        b = self.backlog
        pipe.zrem(self.temporary, *(k.partition(":")[2] for k in self.evicted))
        for key in self.evicted:
            b.client.queue_control(pipe, "discard", key)
        pipe.zadd(self.waiting, dict.fromkeys(self.evicted, int(time.time() * 1000)))
