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
connection (every command waiting on it fails; the next call connects again), the retry
policy redis-py's asyncio connection would apply (none unless ``retry_on_error`` names
errors: the worker sets none, so no command is sent twice by the client), AUTH / SELECT /
CLIENT SETNAME from the client's URL, and a command whose caller is cancelled before it
left is not sent. What it does better: a caller cancelled while waiting does not cost the
connection (its reply is read and dropped, the others stay in step).

Only non-blocking commands whose replies are read undecoded (bytes) go through it: every
Lua script of ``RedisBus`` (``Scripts.call``), the follow-up peek and the session catch-up
``HMGET``. A blocking read would stall every caller behind it. Clients it cannot reproduce
(TLS, RESP3, Sentinel, a credential provider, a ``socket_timeout``, fakeredis) get ``None`` from
:meth:`Multiplexed.for_client`, and their callers use redis-py as before.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import socket
from typing import Any

import hiredis
from redis._parsers.base import BaseParser
from redis.asyncio import Redis
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError, DataError, InvalidResponse
from redis.exceptions import TimeoutError as RedisTimeoutError

_MORE = object()  # hiredis: no complete reply buffered yet


class _Link(asyncio.Protocol):
    """One TCP (or Unix) connection: writes batched per loop iteration, replies in order.

    A command waits in ``unsent`` until the iteration's flush; one whose caller was
    cancelled by then is never sent (as with redis-py, which sends nothing for it). Sent
    commands wait in ``waiting``, in the order Redis will answer them."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.reader = hiredis.Reader(
            protocolError=InvalidResponse, replyError=BaseParser.parse_error, notEnoughData=_MORE
        )
        self.unsent: list[tuple[asyncio.Future[Any], bytes]] = []
        self.waiting: collections.deque[asyncio.Future[Any]] = collections.deque()
        self.lost: ConnectionError | None = None

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
            raise ConnectionError(*self.lost.args)
        fut = self.loop.create_future()
        if not self.unsent:
            self.loop.call_soon(self._flush)
        self.unsent.append((fut, packed))
        return fut

    def _flush(self) -> None:
        batch, self.unsent = self.unsent, []
        if self.lost is not None or self.transport is None:
            return
        chunks = []
        for fut, packed in batch:
            if not fut.done():  # cancelled before it left: not sent at all
                self.waiting.append(fut)
                chunks.append(packed)
        if chunks:
            self.transport.write(b"".join(chunks) if len(chunks) > 1 else chunks[0])

    def close(self, exc: ConnectionError | None = None) -> None:
        self._fail(exc or ConnectionError("connection closed"))
        if self.transport is None:
            return
        if self.loop.is_closed():  # a former event loop's link (tests): close the socket itself
            sock = self.transport.get_extra_info("socket")
            with contextlib.suppress(OSError):
                if sock is not None:
                    sock.shutdown(socket.SHUT_RDWR)
            return
        self.transport.abort()

    def _fail(self, exc: ConnectionError) -> None:
        if self.lost is None:
            self.lost = exc
        failed = [fut for fut, _ in self.unsent] + list(self.waiting)
        self.unsent.clear()
        self.waiting.clear()
        for fut in failed:
            if not fut.done():
                fut.set_exception(ConnectionError(*exc.args))  # one instance per caller


def _pack(args: tuple[Any, ...]) -> bytes:
    """The command's bytes; a value hiredis cannot take is redis-py's ``DataError``, and
    text that cannot be encoded (a lone surrogate) the ``UnicodeEncodeError`` redis-py
    raises too (tests/test_packing.py)."""
    try:
        return hiredis.pack_command(args)
    except TypeError as exc:
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
        self._retries = self.retry._retries
        self.commands = 0  # sent (the benches count round trips with it)
        self._link: _Link | None = None
        self._connecting: asyncio.Task[_Link] | None = None
        self._epoch = 0  # aclose() moves it on: a connect begun before is not kept

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
        if any("sentinel" in c.__module__ for c in mro):  # the master is found per connection
            return None
        if issubclass(conn_class, SSLConnection) or not issubclass(
            conn_class, (Connection, UnixDomainSocketConnection)
        ):
            return None
        kw = pool.connection_kwargs
        if kw.get("credential_provider") is not None or str(kw.get("protocol", 2)) == "3":
            return None
        if kw.get("socket_timeout"):  # a read timeout per command: not reproduced here
            return None
        return cls(
            host=kw.get("host", "localhost"),
            port=int(kw.get("port", 6379)),
            path=kw.get("path", "") if issubclass(conn_class, UnixDomainSocketConnection) else "",
            db=int(kw.get("db", 0) or 0),
            username=kw.get("username"),
            password=kw.get("password"),
            client_name=kw.get("client_name"),
            connect_timeout_s=kw.get("socket_connect_timeout"),
            retry=_retry_of(kw),
        )

    async def execute(self, *args: Any) -> Any:
        """Send one command, return its reply undecoded; retried as the client would."""
        packed = _pack(args)
        link = self._link
        if self._retries == 0 and link is not None and link.usable and link.loop is _loop():
            self.commands += 1  # the common case: connected, nothing to retry
            return await link.call(packed)

        async def once() -> Any:
            link = await self._connected()
            self.commands += 1
            return await link.call(packed)

        async def failed(_: Exception) -> None:
            return None  # the lost link is replaced by the next attempt

        return await self.retry.call_with_retry(once, failed)

    async def aclose(self) -> None:
        """Close the connection (and one being opened); a later call connects again."""
        self._epoch += 1
        self._connecting = None  # a connect begun before fails its own callers only
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
            self._link = None
            with contextlib.suppress(Exception):
                link.close()
        task = self._connecting
        if task is None or task.get_loop() is not loop or task.done():
            # its own task: a caller cancelled while it connects cancels only itself
            task = self._connecting = loop.create_task(self._open(loop, self._epoch))
            task.add_done_callback(_retrieved)  # when every caller was cancelled
        return await asyncio.shield(task)

    async def _open(self, loop: asyncio.AbstractEventLoop, epoch: int) -> _Link:
        try:
            link = await self._handshake(loop)
            if epoch != self._epoch:  # closed while it connected
                link.close()
                raise ConnectionError("the connection was closed while it was opened")
            self._link = link
            return link
        finally:
            if self._connecting is asyncio.current_task():
                self._connecting = None

    async def _handshake(self, loop: asyncio.AbstractEventLoop) -> _Link:
        where = self.path or f"{self.host}:{self.port}"
        try:
            if self.path:
                opening = loop.create_unix_connection(lambda: _Link(loop), self.path)
            else:
                opening = loop.create_connection(lambda: _Link(loop), self.host, self.port)
            _, link = await asyncio.wait_for(opening, self.connect_timeout_s)
        except (OSError, TimeoutError) as exc:
            raise ConnectionError(f"Error connecting to {where}. {exc}") from None
        if not self.path:
            _detect_dead_peers(link)
        try:
            if self.username or self.password:  # as redis-py: no AUTH for an empty password
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


DEAD_PEER_S = 30  # a vanished Redis (or network) fails the waiting commands after this


def _detect_dead_peers(link: _Link) -> None:
    """Every turn's commands share this connection: a peer that vanished without a FIN
    (a partitioned network, a powered-off host) must not hold them until TCP's ~15-minute
    retransmission gives up. Keepalive probes find it while the link idles; a user timeout
    drops it when sent bytes stay unacknowledged (a busy Redis still acknowledges them: its
    kernel does). Then every waiting command fails with ``ConnectionError``."""
    sock = link.transport.get_extra_info("socket") if link.transport else None
    if sock is None:
        return
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (
            ("TCP_KEEPIDLE", DEAD_PEER_S // 3),
            ("TCP_KEEPINTVL", DEAD_PEER_S // 6),
            ("TCP_KEEPCNT", 3),
            ("TCP_USER_TIMEOUT", DEAD_PEER_S * 1000),
        ):
            if hasattr(socket, name):  # Linux; elsewhere the system's defaults
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


_loop = asyncio.get_running_loop


def _retrieved(task: asyncio.Task[_Link]) -> None:
    if not task.cancelled():
        task.exception()


def _retry_of(kw: dict[str, Any]) -> Retry:
    """What redis-py's asyncio connection makes of these settings: no retry unless
    ``retry_on_error`` (or ``retry_on_timeout``) names errors; then the given ``Retry``'s
    backoff and count (else one retry), for those errors only."""
    errors = list(kw.get("retry_on_error") or [])
    if kw.get("retry_on_timeout"):
        errors.append(RedisTimeoutError)
    if not errors:
        return Retry(NoBackoff(), 0)
    given = kw.get("retry")
    if given is None:
        return Retry(NoBackoff(), 1, tuple(errors))
    return Retry(copy.deepcopy(given._backoff), given._retries, tuple(errors))
