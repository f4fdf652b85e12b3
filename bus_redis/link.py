"""One connection to Redis as an asyncio protocol: what a caller sends waits in a buffer
written once per event-loop iteration, and replies, parsed by hiredis into redis-py's
exceptions, resolve the callers in the order they sent. Used by :mod:`bus_redis.mux`."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
from typing import Any

import hiredis
from redis._parsers.base import BaseParser
from redis.exceptions import ConnectionError, DataError, InvalidResponse

_MORE = object()  # hiredis: no complete reply buffered yet


class _Unit:
    """Several replies that answer one caller (a MULTI ... EXEC block sent as one)."""

    __slots__ = ("fut", "left", "replies")

    def __init__(self, fut: asyncio.Future[Any], n: int) -> None:
        self.fut, self.left = fut, n
        self.replies: list[Any] = []


class _Link(asyncio.Protocol):
    """One TCP (or Unix) connection: writes batched per loop iteration, replies in order.

    A command waits in ``unsent`` until the iteration's flush; one whose caller was
    cancelled by then is never sent (as with redis-py, which sends nothing for it). Sent
    commands wait in ``waiting``, in the order Redis will answer them. A caller may send
    several commands as one unit (``call(packed, replies=n)``): they leave together or not
    at all, and its future gets the list of their n replies."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.reader = hiredis.Reader(
            protocolError=InvalidResponse, replyError=BaseParser.parse_error, notEnoughData=_MORE
        )
        self.unsent: list[tuple[asyncio.Future[Any] | _Unit, bytes]] = []
        self.waiting: collections.deque[asyncio.Future[Any] | _Unit] = collections.deque()
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
            head = self.waiting[0]
            if isinstance(head, _Unit):  # one of several replies to one caller
                head.replies.append(reply)
                head.left -= 1
                if head.left:
                    continue
                self.waiting.popleft()
                if not head.fut.done():
                    head.fut.set_result(head.replies)
                continue
            fut = head
            self.waiting.popleft()
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

    def call(self, packed: bytes, replies: int = 1, *, now: bool = False) -> asyncio.Future[Any]:
        """Send ``packed`` with this iteration's batch; ``now``: at once (with what is
        already waiting before it, in order), saving the wait for the iteration's end."""
        if self.lost is not None:
            raise ConnectionError(*self.lost.args)
        fut = self.loop.create_future()
        if not self.unsent and not now:
            self.loop.call_soon(self._flush)
        self.unsent.append((fut if replies == 1 else _Unit(fut, replies), packed))
        if now:
            self._flush()  # (a flush scheduled before finds nothing left)
        return fut

    def _flush(self) -> None:
        batch, self.unsent = self.unsent, []
        if not batch or self.lost is not None or self.transport is None:
            return
        chunks = []
        for item, packed in batch:
            if not (item.fut if isinstance(item, _Unit) else item).done():
                self.waiting.append(item)  # (cancelled before it left: not sent at all)
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
        failed = [item for item, _ in self.unsent] + list(self.waiting)
        self.unsent.clear()
        self.waiting.clear()
        for item in failed:
            fut = item.fut if isinstance(item, _Unit) else item
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
