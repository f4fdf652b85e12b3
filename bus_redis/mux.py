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
import contextlib
import copy
from collections.abc import Awaitable
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from bus_redis.link import _detect_dead_peers, _Link, _pack
from bus_redis.server_watch import ServerWatch, run_id


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
        # told which server each (re)connect reaches, before any command of the new
        # connection is answered (``bus_redis.server_watch``)
        self.server_watch: ServerWatch | None = None

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

    async def execute(self, *args: Any, now: bool = False) -> Any:
        """Send one command, return its reply undecoded; retried as the client would.
        ``now``: written at once instead of at the end of the event loop's iteration
        (a latency that matters more than a shared write: a stopped turn's commit)."""
        return await self._send(_pack(args), 1, now=now)

    def send(self, args: tuple[Any, ...], *, now: bool = False) -> Awaitable[Any]:
        """:meth:`execute` for a caller that awaits at once (``Scripts.call``): connected
        and with nothing to retry, the awaitable is the reply's future itself."""
        return self._send(_pack(args), 1, now=now)

    async def transaction(self, *commands: tuple[Any, ...]) -> list[Any]:
        """``MULTI``, the commands, ``EXEC``, sent as one unit (never split, never
        interleaved with another caller's commands); returns ``EXEC``'s replies. Raises as
        redis-py's ``pipeline(transaction=True).execute()`` does: a command refused when
        queued, an aborted ``EXEC``, or the first error among the replies."""
        packed = b"".join(_pack(c) for c in (("MULTI",), *commands, ("EXEC",)))
        replies = await self._send(packed, len(commands) + 2)
        for reply in replies[1:-1]:  # QUEUED, or why the command was refused
            if isinstance(reply, Exception):
                raise reply
        done = replies[-1]
        if isinstance(done, Exception):
            raise done
        for reply in done:
            if isinstance(reply, Exception):
                raise reply
        return list(done)

    def _send(self, packed: bytes, replies: int, *, now: bool = False) -> Awaitable[Any]:
        """``packed`` (``replies`` commands, one unit) on the connection: its reply, or
        the list of its replies. The common case (connected, nothing to retry) hands back
        the link's future, no coroutine on the way."""
        link = self._link
        if self._retries == 0 and link is not None and link.usable and link.loop is _loop():
            self.commands += replies
            return link.call(packed, replies, now=now)
        return self._send_retried(packed, replies, now=now)

    async def _send_retried(self, packed: bytes, replies: int, *, now: bool) -> Any:
        async def once() -> Any:
            link = await self._connected()
            self.commands += replies
            return await link.call(packed, replies, now=now)

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
            if self.server_watch is not None:
                try:
                    server = run_id(await link.call(_pack(("INFO", "server"))))
                except ResponseError:  # no INFO (fakeredis, a user without +info): not
                    server = ""  # told apart this time; the last id known stays
                self.server_watch.seen(server)
        except BaseException:
            link.close()
            raise
        return link


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
