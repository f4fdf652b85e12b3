"""The provider's HTTP client: POSTs to one URL over pooled HTTP/1.1 connections.

Built on httpcore (the connection layer under httpx) directly: httpx's per-request layers
(request and response models, header merging, cookies, auth and redirect flows, event
hooks) cost about 0.4 ms CPU a call, as much as the exchange itself (bench/provider.py).
What of httpx a provider relies on is kept here:

- proxies from the environment (``HTTPS_PROXY``, ``HTTP_PROXY``, ``ALL_PROXY``,
  ``NO_PROXY``), chosen once: every call goes to the same URL;
- TLS with the system's CAs, ``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` honoured;
- a connect timeout and a read / write / pool timeout;
- bodies sent with ``Content-Encoding`` gzip or deflate are decoded (none is asked for);
- every failure of the exchange is one ``HTTPError``: retryable or not, with a message
  named as the openai SDK names it (``APITimeoutError``, ``APIConnectionError``).
"""

from __future__ import annotations

import contextlib
import urllib.parse
import urllib.request
import zlib
from collections.abc import AsyncIterator
from typing import Any

import httpcore2 as httpcore
import httpx2

KEEPALIVE_S = 5.0  # an idle connection is closed after this (httpx's default)
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
        return HTTPError(f"APITimeoutError: {exc or 'request timed out'}", retryable=True)
    if isinstance(exc, httpcore.UnsupportedProtocol):
        return HTTPError(f"APIConnectionError: {exc}", retryable=False)
    return HTTPError(f"APIConnectionError: {exc or type(exc).__name__}", retryable=True)


class Response:
    """A response whose body is read on demand: whole (``read``) or in lines (``lines``)."""

    def __init__(self, raw: httpcore.Response) -> None:
        self.status = raw.status
        self.headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in raw.headers}
        self._raw = raw
        self._decode = _Decoder(self.headers.get("content-encoding", ""))

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._raw.aiter_stream():
                if data := self._decode(chunk):
                    yield data
            if tail := self._decode(None):
                yield tail
        except _FAILURES as exc:
            raise failure(exc) from exc

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])

    async def lines(self) -> AsyncIterator[str]:
        """The body's lines (ends: \\n, \\r\\n or \\r), without their ends."""
        rest = b""
        async for chunk in self.chunks():
            parts = (rest + chunk).splitlines(keepends=True)
            rest = parts.pop() if parts and not parts[-1].endswith((b"\n", b"\r")) else b""
            for part in parts:
                yield part.rstrip(b"\r\n").decode("utf-8", "replace")
        if rest:
            yield rest.decode("utf-8", "replace")


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
        self._invalid = _invalid(url)
        self._url = httpcore.URL(url) if self._invalid is None else None
        self._headers = [(k.encode(), v.encode()) for k, v in headers.items()]
        if self._url is not None:
            host = self._url.host
            if self._url.port is not None:
                host += b":%d" % self._url.port
            self._headers.insert(0, (b"Host", host))
        self.timeout = {
            "connect": connect_s,
            "read": timeout_s,
            "write": timeout_s,
            "pool": timeout_s,
        }
        self._extensions = {"timeout": self.timeout}
        per_shard = -(-max_connections // shards)
        tls = httpx2.create_ssl_context(trust_env=True)  # one CA load (SSL_CERT_FILE honoured)
        self.pools = [_pool(url, tls, per_shard) for _ in range(shards)]
        self._turn = 0

    def _request(self, content: bytes) -> httpcore.Request:
        if self._invalid is not None:
            raise HTTPError(f"APIConnectionError: {self._invalid}", retryable=False)
        headers = [*self._headers, (b"Content-Length", b"%d" % len(content))]
        assert self._url is not None
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
            yield Response(raw)
        finally:
            await raw.aclose()

    async def aclose(self) -> None:
        for pool in self.pools:
            await pool.aclose()


def _invalid(url: str) -> str | None:
    """Why ``url`` cannot be posted to, or None."""
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 (raises on a port that is no number)
    except ValueError as exc:
        return f"invalid URL {url!r}: {exc}"
    if parts.scheme not in ("http", "https"):
        return f"unsupported URL scheme in {url!r} (http or https)"
    if not parts.hostname:
        return f"no host in URL {url!r}"
    return None


def _pool(url: str, tls: Any, connections: int) -> httpcore.AsyncConnectionPool:
    """A pool to ``url``'s origin: directly, or through the proxy the environment names
    for it (as httpx does with ``trust_env``)."""
    common: dict[str, Any] = {
        "ssl_context": tls,
        "max_connections": connections,
        "max_keepalive_connections": connections,
        "keepalive_expiry": KEEPALIVE_S,
    }
    proxy = _proxy_for(url)
    if proxy is None:
        return httpcore.AsyncConnectionPool(**common)
    parts = urllib.parse.urlsplit(proxy)
    auth = None
    if parts.username is not None:
        auth = (urllib.parse.unquote(parts.username), urllib.parse.unquote(parts.password or ""))
        parts = parts._replace(netloc=parts.netloc.rpartition("@")[2])
    if parts.scheme in ("socks5", "socks5h"):
        return httpcore.AsyncSOCKSProxy(proxy_url=parts.geturl(), proxy_auth=auth, **common)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"unsupported proxy scheme in {proxy!r} (http, https, socks5)")
    return httpcore.AsyncHTTPProxy(proxy_url=parts.geturl(), proxy_auth=auth, **common)


def _proxy_for(url: str) -> str | None:
    proxies = urllib.request.getproxies_environment()
    parts = urllib.parse.urlsplit(url)
    proxy = proxies.get(parts.scheme) or proxies.get("all")
    bypass = urllib.request.proxy_bypass_environment  # type: ignore[attr-defined]
    if not proxy or bypass(parts.netloc, proxies):
        return None
    return proxy if "://" in proxy else "http://" + proxy


class _Decoder:
    """A body's ``Content-Encoding`` undone, chunk by chunk (``None``: the end)."""

    def __init__(self, encoding: str) -> None:
        names = [e.strip().lower() for e in encoding.split(",") if e.strip()]
        self.name = names[0] if len(names) == 1 else encoding
        self.z: Any = None
        if names in ([], ["identity"]):
            return
        if self.name not in ("gzip", "x-gzip", "deflate"):
            raise HTTPError(
                f"APIConnectionError: unsupported Content-Encoding {encoding!r}", retryable=False
            )
        self.deflate = self.name == "deflate"  # zlib-wrapped, or raw as some servers send it
        self.z = zlib.decompressobj(zlib.MAX_WBITS if self.deflate else zlib.MAX_WBITS | 16)

    def __call__(self, chunk: bytes | None) -> bytes:
        if self.z is None:
            return chunk or b""
        try:
            if chunk is None:
                return bytes(self.z.flush())
            if self.deflate:
                self.deflate = False
                try:
                    return bytes(self.z.decompress(chunk))
                except zlib.error:
                    self.z = zlib.decompressobj(-zlib.MAX_WBITS)
            return bytes(self.z.decompress(chunk))
        except zlib.error as exc:
            message = f"APIConnectionError: the body is not {self.name}: {exc}"
            raise HTTPError(message, retryable=True) from exc
