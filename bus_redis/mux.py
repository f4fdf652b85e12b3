"""One connection for the turn path's commands, shared by every turn, pipelined as they come.

redis-py's asyncio pool checks a connection out for each command, polls it for stray data
(a zero-timeout read), sends, waits, checks it back in: ~55 µs of CPU per command with 64
turns in flight, most of a worker's time. Redis answers the commands of one connection in
the order it got them, so concurrent callers can share one: each command's bytes go into
a buffer written once per event-loop iteration (whatever was issued in that iteration, one
``send``), and each reply, parsed by hiredis, resolves the oldest waiting caller: ~3 µs a
command under the same load (``bench/baseline.py``).

What it keeps from redis-py: the error classes (replies are parsed into redis-py's
exceptions: ``NoScriptError``, ``OutOfMemoryError``, ...), ``ConnectionError`` on a lost
connection, the client's retry policy (the same ``Retry`` and errors), AUTH / SELECT /
CLIENT SETNAME from the client's URL. What it does better: a caller cancelled while waiting
does not cost the connection (its reply is read and dropped, the others stay in step).

Only non-blocking commands whose replies are read undecoded (bytes) go through it: the
Lua scripts and the follow-up peek (``RedisBus``). A blocking read would stall every caller
behind it. Clients it cannot reproduce (TLS, RESP3, a credential provider, fakeredis) get
``None`` from :meth:`Multiplexed.for_client`, and their callers use redis-py as before.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
from typing import Any

import hiredis
from redis._parsers.base import BaseParser
from redis.asyncio import Redis
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError, DataError, InvalidResponse

_MORE = object()  # hiredis: no complete reply buffered yet


class _Link(asyncio.Protocol):
    """One TCP (or Unix) connection: writes batched per loop iteration, replies in order."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.reader = hiredis.Reader(
            protocolError=InvalidResponse, replyError=BaseParser.parse_error, notEnoughData=_MORE
        )
        self.waiting: collections.deque[asyncio.Future[Any]] = collections.deque()
        self.out: list[bytes] = []
        self.lost: Exception | None = None

    # --- asyncio.Protocol --------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while True:
            try:
                reply = self.reader.gets()
            except InvalidResponse as exc:  # the stream is out of step: nothing can be trusted
                self.close(ConnectionError(f"protocol error from Redis: {exc}"))
                return
            if reply is _MORE:
                return
            if not self.waiting:
                self.close(ConnectionError("a reply nobody asked for"))
                return
            fut = self.waiting.popleft()
            if fut.done():  # its caller was cancelled: the reply is dropped, the rest in step
                continue
            if isinstance(reply, Exception):  # an error reply (a nested one is a value)
                fut.set_exception(reply)
            else:
                fut.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(ConnectionError(f"Connection closed by server. {exc or ''}".strip()))

    # --- callers -----------------------------------------------------------------------
    @property
    def usable(self) -> bool:
        return self.lost is None and self.transport is not None

    def call(self, packed: bytes) -> asyncio.Future[Any]:
        if self.lost is not None:
            raise self.lost
        fut = self.loop.create_future()
        if not self.out:
            self.loop.call_soon(self._flush)
        self.out.append(packed)
        self.waiting.append(fut)
        return fut

    def _flush(self) -> None:
        if self.out and self.lost is None and self.transport is not None:
            data = b"".join(self.out) if len(self.out) > 1 else self.out[0]
            self.out.clear()
            self.transport.write(data)

    def close(self, exc: Exception | None = None) -> None:
        self._fail(exc or ConnectionError("connection closed"))
        if self.transport is not None:
            self.transport.abort()

    def _fail(self, exc: Exception) -> None:
        if self.lost is None:
            self.lost = exc
        self.out.clear()
        while self.waiting:
            fut = self.waiting.popleft()
            if not fut.done():
                fut.set_exception(exc)


def _pack(args: tuple[Any, ...]) -> bytes:
    try:
        return hiredis.pack_command(args)
    except (TypeError, ValueError) as exc:
        raise DataError(f"cannot send {[type(a).__name__ for a in args]}: {exc}") from None


class Multiplexed:
    """Commands of many concurrent callers over one connection (see the module's text)."""

    def __init__(
        self,
        *,
        host: str = "localhost",
        port: int = 6379,
        path: str = "",
        db: int = 0,
        username: str | None = None,
        password: str | None = None,
        client_name: str | None = None,
        connect_timeout_s: float | None = None,
        retry: Retry | None = None,
    ) -> None:
        self.host, self.port, self.path, self.db = host, port, path, db
        self.username, self.password, self.client_name = username, password, client_name
        self.connect_timeout_s = connect_timeout_s
        self.retry = retry or Retry(NoBackoff(), 0)
        self.commands = 0  # sent (the benches count round trips with it)
        self._link: _Link | None = None
        self._connecting: asyncio.Future[_Link] | None = None

    @classmethod
    def for_client(cls, redis: Redis) -> Multiplexed | None:
        """A multiplexer with the connection settings of ``redis``'s pool, or None when
        this module cannot reproduce them (then use ``redis`` itself)."""
        pool = getattr(redis, "connection_pool", None)
        conn_class = getattr(pool, "connection_class", None)
        if pool is None or not isinstance(conn_class, type):
            return None
        mro = conn_class.__mro__
        if any(c.__module__.split(".")[0] == "fakeredis" for c in mro):
            return None
        if issubclass(conn_class, SSLConnection) or not issubclass(
            conn_class, (Connection, UnixDomainSocketConnection)
        ):
            return None
        kw = pool.connection_kwargs
        if kw.get("credential_provider") is not None or str(kw.get("protocol", 2)) == "3":
            return None
        given = kw.get("retry")  # redis-py's own (sync or asyncio): its policy, awaited here
        retry = None
        if given is not None:
            errors = tuple(given._supported_errors)
            retry = Retry(copy.deepcopy(given._backoff), given._retries, errors)
            retry.update_supported_errors(kw.get("retry_on_error") or [])
        return cls(
            host=kw.get("host", "localhost"),
            port=int(kw.get("port", 6379)),
            path=kw.get("path", "") if issubclass(conn_class, UnixDomainSocketConnection) else "",
            db=int(kw.get("db", 0) or 0),
            username=kw.get("username"),
            password=kw.get("password"),
            client_name=kw.get("client_name"),
            connect_timeout_s=kw.get("socket_connect_timeout"),
            retry=retry,
        )

    async def execute(self, *args: Any) -> Any:
        """Send one command, return its reply undecoded; retried as the client would."""
        packed = _pack(args)

        async def once() -> Any:
            link = await self._connected()
            self.commands += 1
            return await link.call(packed)

        async def failed(_: Exception) -> None:
            return None  # the lost link is replaced by the next attempt

        return await self.retry.call_with_retry(once, failed)

    async def aclose(self) -> None:
        link, self._link = self._link, None
        if link is not None:
            link.close()

    # --- the connection ----------------------------------------------------------------
    async def _connected(self) -> _Link:
        loop = asyncio.get_running_loop()
        link = self._link
        if link is not None and link.usable and link.loop is loop:
            return link
        if link is not None and link.loop is not loop:  # a former event loop's (tests)
            with contextlib.suppress(Exception):
                link.close()
        connecting = self._connecting
        if connecting is None or connecting.get_loop() is not loop:
            connecting = self._connecting = loop.create_future()
            try:
                self._link = await self._open(loop)
                connecting.set_result(self._link)
            except BaseException as exc:
                connecting.set_exception(exc)
                connecting.exception()  # retrieved: other waiters may be none
                raise
            finally:
                self._connecting = None
            return self._link
        return await asyncio.shield(connecting)

    async def _open(self, loop: asyncio.AbstractEventLoop) -> _Link:
        where = self.path or f"{self.host}:{self.port}"
        try:
            if self.path:
                opening = loop.create_unix_connection(lambda: _Link(loop), self.path)
            else:
                opening = loop.create_connection(lambda: _Link(loop), self.host, self.port)
            _, link = await asyncio.wait_for(opening, self.connect_timeout_s)
        except (TimeoutError, OSError) as exc:
            raise ConnectionError(f"Error connecting to {where}. {exc}") from None
        try:
            if self.password is not None:
                auth = (self.username, self.password) if self.username else (self.password,)
                await link.call(_pack(("AUTH", *auth)))
            if self.client_name:
                await link.call(_pack(("CLIENT", "SETNAME", self.client_name)))
            if self.db:
                await link.call(_pack(("SELECT", self.db)))
        except BaseException:
            link.close()
            raise
        return link
