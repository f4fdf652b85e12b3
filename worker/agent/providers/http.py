"""The provider's HTTP client: POSTs to one URL over pooled HTTP/1.1 connections.

Built on httpcore (the connection layer under httpx) directly: httpx's per-request layers
(request and response models, header merging, cookies, auth and redirect flows, event
hooks) cost about 0.3 ms CPU a call, as much as the exchange itself (bench/provider.py).
What of httpx a provider relies on is kept here:

- the URL parsed and normalised by httpx (percent-encoding, IDNA host names, IPv6
  literals, default ports; credentials in it become Basic auth, as httpx sends them);
- the proxy the environment names for that URL, matched by httpx's own rules
  (``HTTPS_PROXY``, ``HTTP_PROXY``, ``ALL_PROXY``, ``NO_PROXY`` with CIDR ranges, IPv6
  and wildcards): decided once, every call goes to the same URL;
- TLS with the system's CAs, ``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` honoured;
- a connect timeout and a read / write / pool timeout;
- ``Accept-Encoding: gzip, deflate``; those codings decoded, others left as they are;
- every failure of the exchange is one ``HTTPError``: retryable or not, with a message
  named as the openai SDK names it (``APITimeoutError``, ``APIConnectionError``).
"""

from __future__ import annotations

import base64
import contextlib
import zlib
from collections.abc import AsyncIterator
from typing import Any

import httpcore2 as httpcore
import httpx2
from httpx2._utils import URLPattern, get_environment_proxies  # httpx's NO_PROXY rules

from worker.agent.providers.wire import (
    BodyTooLargeError,
    Decoder,
    HeldWrites,
    HeldWritesBackend,
    TooManyCodingsError,
)

KEEPALIVE_S = 5.0  # an idle connection is closed after this (httpx's default)
# what of a body is read, decoded (an answer is kilobytes; a server that sends more, or a
# small gzip body that inflates to more, fails the call instead of the worker's memory).
# A whole body is parsed as JSON at once: 8 MiB of the smallest objects ("{},{},...")
# parse to ~200 MiB in Python, so the bound is kept well below what an answer needs
MAX_BODY_BYTES = 8 * 1024 * 1024
_FAILURES = (
    httpcore.TimeoutException,
    httpcore.NetworkError,
    httpcore.ProtocolError,
    httpcore.ProxyError,
    httpcore.UnsupportedProtocol,
    OSError,
)


class HTTPError(Exception):
    """The exchange failed (no status was read, or its body could not be)."""

    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


def failure(exc: BaseException) -> HTTPError:
    if isinstance(exc, HTTPError):
        return exc
    if isinstance(exc, httpcore.TimeoutException):
        return HTTPError(f"APITimeoutError: {str(exc) or 'request timed out'}", retryable=True)
    # a request this client cannot send: sending it again would not help
    retryable = not isinstance(exc, (httpcore.UnsupportedProtocol, httpcore.LocalProtocolError))
    return HTTPError(f"APIConnectionError: {str(exc) or type(exc).__name__}", retryable=retryable)


class Response:
    """A response whose body is read on demand: whole (``read``) or in lines (``lines``)."""

    def __init__(self, raw: httpcore.Response) -> None:
        self.status = raw.status
        self.headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in raw.headers}
        self._raw = raw
        self._decode = Decoder(self.headers.get("content-encoding", ""), MAX_BODY_BYTES)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The decoded body, chunk by chunk. At most ``MAX_BODY_BYTES`` are read, and no
        coding makes more of them (a body of empty compressed blocks, or a gzip bomb,
        fails the call like a body too long)."""
        left = MAX_BODY_BYTES
        try:
            async for chunk in self._raw.aiter_stream():
                left -= len(chunk)
                if left < 0:
                    raise BodyTooLargeError
                if data := self._decode(chunk):
                    yield data
            if tail := self._decode(None):
                yield tail
        except _FAILURES as exc:
            raise failure(exc) from exc
        except BodyTooLargeError:
            message = f"APIConnectionError: the response body is larger than {MAX_BODY_BYTES} bytes"
            raise HTTPError(message, retryable=False) from None
        except TooManyCodingsError as exc:
            raise HTTPError(f"APIConnectionError: {exc}", retryable=False) from None
        except zlib.error as exc:
            message = f"APIConnectionError: the body is not {self._decode.name}: {exc}"
            raise HTTPError(message, retryable=True) from exc

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])

    async def lines(self) -> AsyncIterator[str]:
        """The body's lines (ends: \\n, \\r\\n or \\r), without their ends; a line that
        comes in many chunks grows in place (linear in its length)."""
        partial = bytearray()
        async for chunk in self.chunks():
            partial += chunk
            if b"\n" not in chunk and b"\r" not in chunk:
                continue
            parts = partial.splitlines(keepends=True)
            partial = parts.pop() if not parts[-1].endswith((b"\n", b"\r")) else bytearray()
            for part in parts:
                yield part.rstrip(b"\r\n").decode("utf-8", "replace")
        if partial:
            yield partial.decode("utf-8", "replace")


class HTTPClient:
    def __init__(
        self,
        url: str,
        *,
        headers: dict[str, str],
        timeout_s: float,
        connect_s: float,
        max_connections: int,
        shards: int,
    ) -> None:
        self.url = url
        self._invalid: str | None = None
        self._headers = [(k.encode(), v.encode()) for k, v in headers.items()]
        self._headers.append((b"Accept-Encoding", b"gzip, deflate"))
        try:
            parsed = _parse_url(url)
        except ValueError as exc:
            self._invalid = str(exc)
            parsed = httpx2.URL("http://invalid/")  # never sent to
        self._url = httpcore.URL(
            scheme=parsed.raw_scheme, host=parsed.raw_host, port=parsed.port, target=parsed.raw_path
        )
        self._headers.insert(0, (b"Host", parsed.netloc))
        if parsed.username or parsed.password:  # as httpx: the URL's credentials, Basic auth
            basic = base64.b64encode(f"{parsed.username}:{parsed.password}".encode())
            self._headers = [(k, v) for k, v in self._headers if k.lower() != b"authorization"]
            self._headers.append((b"Authorization", b"Basic " + basic))
        self.timeout = {
            "connect": connect_s,
            "read": timeout_s,
            "write": timeout_s,
            "pool": timeout_s,
        }
        self._extensions = {"timeout": self.timeout}
        per_shard = -(-max_connections // shards)
        tls = httpx2.create_ssl_context(trust_env=True)  # one CA load (SSL_CERT_FILE honoured)
        proxy = _proxy_for(parsed) if self._invalid is None else None
        self.pools = [_pool(proxy, tls, per_shard) for _ in range(shards)]
        self._turn = 0

    def _request(self, content: bytes) -> httpcore.Request:
        if self._invalid is not None:
            raise HTTPError(f"APIConnectionError: {self._invalid}", retryable=False)
        headers = [*self._headers, (b"Content-Length", b"%d" % len(content))]
        return httpcore.Request(
            b"POST", self._url, headers=headers, content=content, extensions=self._extensions
        )

    def _next(self) -> httpcore.AsyncConnectionPool:
        """Several small pools, taken in turn: a pool's bookkeeping looks at every one of
        its connections on every request, so 64 concurrent calls through one pool of 64
        connections cost ~1 ms CPU more each than through 8 pools of 8."""
        self._turn = (self._turn + 1) % len(self.pools)
        return self.pools[self._turn]

    async def post(self, content: bytes) -> tuple[int, dict[str, str], bytes]:
        """Status, headers (names in lower case) and the decoded body."""
        async with self.stream(content) as response:
            return response.status, response.headers, await response.read()

    @contextlib.asynccontextmanager
    async def stream(self, content: bytes) -> AsyncIterator[Response]:
        """The response once its head is read; its connection is let go at the block's
        end (kept in the pool when the body was read to its end, else closed)."""
        request = self._request(content)
        try:
            raw = await self._next().handle_async_request(request)
        except _FAILURES as exc:
            raise failure(exc) from exc
        try:
            await _not_stale(raw)
            yield Response(raw)
        finally:
            await raw.aclose()

    async def aclose(self) -> None:
        for pool in self.pools:
            await pool.aclose()


async def _not_stale(raw: httpcore.Response) -> None:
    """Refuse an answer that is not this request's. A server that sent more than its last
    answer (a Content-Length too short, an answer twice) leaves bytes that h11 keeps for
    the connection's next cycle: the next call on it, maybe another user's turn, would be
    answered from them, before its own request even left. Such a head is read while the
    request is still held (``HeldWrites``): the connection is closed (never pooled again)
    and the call fails retryably, to be made again on a connection of its own."""
    stream = raw.extensions.get("network_stream")
    if isinstance(stream, HeldWrites) and stream.unsent():
        await stream.aclose()
        await raw.aclose()
        message = "APIConnectionError: an answer came before the request was sent (stale bytes)"
        raise HTTPError(message, retryable=True)


def _parse_url(url: str) -> httpx2.URL:
    """``url`` as httpx reads it; ValueError says why it cannot be posted to."""
    try:
        parsed = httpx2.URL(url)
    except (httpx2.InvalidURL, TypeError, ValueError) as exc:
        raise ValueError(f"invalid URL {url!r}: {exc}") from None
    if parsed.scheme not in ("http", "https"):
        raise ValueError(f"unsupported URL scheme in {url!r} (http or https)")
    if not parsed.host:
        raise ValueError(f"no host in URL {url!r}")
    if parsed.port is not None and not 0 < parsed.port < 65536:
        raise ValueError(f"invalid port in URL {url!r}")
    return parsed


def _proxy_for(url: httpx2.URL) -> httpx2.Proxy | None:
    """The proxy the environment names for ``url``, as httpx's ``trust_env`` picks it."""
    patterns = sorted(
        ((URLPattern(key), proxy) for key, proxy in get_environment_proxies().items()),
        key=lambda item: item[0],
    )
    for pattern, proxy in patterns:
        if pattern.matches(url):
            return None if proxy is None else httpx2.Proxy(proxy)  # ValueError: its scheme
    return None


def _pool(proxy: httpx2.Proxy | None, tls: Any, connections: int) -> httpcore.AsyncConnectionPool:
    """A pool to the URL's origin: directly, or through ``proxy`` (built as httpx does)."""
    common: dict[str, Any] = {
        "network_backend": HeldWritesBackend(),
        "ssl_context": tls,
        "max_connections": connections,
        "max_keepalive_connections": connections,
        "keepalive_expiry": KEEPALIVE_S,
    }
    if proxy is None:
        return httpcore.AsyncConnectionPool(**common)
    u = proxy.url
    where = httpcore.URL(scheme=u.raw_scheme, host=u.raw_host, port=u.port, target=u.raw_path)
    if u.scheme in ("socks5", "socks5h"):
        return httpcore.AsyncSOCKSProxy(proxy_url=where, proxy_auth=proxy.raw_auth, **common)
    return httpcore.AsyncHTTPProxy(
        proxy_url=where,
        proxy_auth=proxy.raw_auth,
        proxy_headers=proxy.headers.raw,
        proxy_ssl_context=proxy.ssl_context,
        **common,
    )
