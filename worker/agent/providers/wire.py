"""Bytes on the provider's connections, below HTTP: writes held until the next read (a
request leaves in one send), and a body's ``Content-Encoding`` undone."""

from __future__ import annotations

import contextlib
import zlib
from typing import Any

import httpcore2 as httpcore

_WBITS = {"gzip": zlib.MAX_WBITS | 16, "x-gzip": zlib.MAX_WBITS | 16, "deflate": zlib.MAX_WBITS}


class HeldWrites(httpcore.AsyncNetworkStream):
    """A connection whose writes wait for its next read: a request's head and body (which
    httpcore writes apart) leave in one send, not two system calls and two segments."""

    def __init__(self, inner: httpcore.AsyncNetworkStream) -> None:
        self._inner = inner
        self._held: list[bytes] = []
        self._timeout: float | None = None

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109
        self._held.append(buffer)
        self._timeout = timeout

    def unsent(self) -> bool:
        """Whether a request written here has not left yet: an answer read meanwhile was
        in the connection's buffer before it, bytes a server sent past its last answer."""
        return bool(self._held)

    async def _flush(self) -> None:
        if self._held:
            data = self._held[0] if len(self._held) == 1 else b"".join(self._held)
            self._held = []
            # as httpcore does: a server that refuses a request (a 413) may close before
            # reading it all; its answer is still read
            with contextlib.suppress(httpcore.WriteError):
                await self._inner.write(data, self._timeout)

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:  # noqa: ASYNC109
        await self._flush()
        return await self._inner.read(max_bytes, timeout)

    async def aclose(self) -> None:
        self._held = []
        await self._inner.aclose()

    async def start_tls(
        self,
        ssl_context: Any,
        server_hostname: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> httpcore.AsyncNetworkStream:
        await self._flush()
        return HeldWrites(await self._inner.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class HeldWritesBackend(httpcore.AsyncNetworkBackend):
    """httpcore's own backend, its connections wrapped in :class:`HeldWrites`."""

    def __init__(self) -> None:
        self._inner = httpcore.AnyIOBackend()

    async def connect_tcp(self, *args: Any, **kwargs: Any) -> httpcore.AsyncNetworkStream:
        return HeldWrites(await self._inner.connect_tcp(*args, **kwargs))

    async def connect_unix_socket(self, *args: Any, **kwargs: Any) -> httpcore.AsyncNetworkStream:
        return HeldWrites(await self._inner.connect_unix_socket(*args, **kwargs))

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


class BodyTooLargeError(ValueError):
    """A coding would inflate the body past the decoder's limit."""


class TooManyCodingsError(ValueError):
    """A body's Content-Encoding names more codings than a decoder takes."""


MAX_CODINGS = 5  # as urllib3 since 2.6


def _zlib_header(two: bytes) -> bool:
    """Whether a deflate body starts with a zlib header (RFC 1950), not raw deflate."""
    return (two[0] & 0x0F) == 8 and ((two[0] << 8) | two[1]) % 31 == 0


class _Inflate:
    """One coding undone, its output bounded by ``limit`` over the whole body (a small
    body may inflate to gigabytes: nothing past the limit is ever made). gzip goes on
    member after member (bytes after a member that start no other are ignored, as httpx
    does); deflate is zlib-wrapped or raw, as the first two bytes say."""

    def __init__(self, name: str, limit: int) -> None:
        self.gzip = name != "deflate"
        self.limit = limit
        self.made = 0
        self.z: Any = zlib.decompressobj(_WBITS[name]) if self.gzip else None
        self.head = b""  # deflate: the first bytes, until two tell its kind
        self.over = False  # gzip: trailing bytes that start no member are ignored

    def _take(self, z: Any, data: bytes) -> bytes:
        out = z.decompress(data, self.limit - self.made + 1)
        self.made += len(out)
        if self.made > self.limit or z.unconsumed_tail:
            raise BodyTooLargeError(f"the body inflates past {self.limit} bytes")
        return bytes(out)

    def __call__(self, data: bytes, end: bool) -> bytes:
        if self.z is None:  # deflate of unknown kind yet
            self.head += data
            if len(self.head) < 2 and not end:
                return b""
            raw = len(self.head) < 2 or not _zlib_header(self.head)
            self.z = zlib.decompressobj(-zlib.MAX_WBITS if raw else zlib.MAX_WBITS)
            data, self.head = self.head, b""
        out = b"" if self.over or not data else self._take(self.z, data)
        while self.gzip and not self.over and self.z.eof and self.z.unused_data:
            rest = self.z.unused_data
            if not rest.startswith(b"\x1f\x8b"):
                self.over = True
                break
            self.z = zlib.decompressobj(_WBITS["gzip"])
            out += self._take(self.z, rest)
        if end:
            out += self.z.flush()
        return out


class Decoder:
    """A body's ``Content-Encoding`` undone, chunk by chunk (``None``: the end): gzip and
    deflate, also chained, each stage's output bounded by ``limit`` (BodyTooLargeError);
    a body with a coding it does not know is left as it is (as httpx does: the status and
    what can be read of it still count). A body that is not what its coding says raises
    ``zlib.error``. More than ``MAX_CODINGS`` codings raise ``TooManyCodingsError`` at
    the first chunk (each stage is a decoder of its own, and a header can name
    thousands: urllib3's CVE-2025-66418)."""

    def __init__(self, encoding: str, limit: int) -> None:
        names = [e.strip().lower() for e in encoding.split(",") if e.strip()]
        names = [n for n in names if n != "identity"]
        self.name = encoding[:100]
        self.stages: list[_Inflate] = []
        self.too_many = len(names) > MAX_CODINGS
        if names and not self.too_many and all(n in _WBITS for n in names):
            self.stages = [_Inflate(n, limit) for n in reversed(names)]  # the last applied first

    def __call__(self, chunk: bytes | None) -> bytes:
        if self.too_many:
            raise TooManyCodingsError(f"more than {MAX_CODINGS} content codings")
        end, data = chunk is None, chunk or b""
        for stage in self.stages:
            data = stage(data, end)
        return data
