"""A worker's HTTP port for operations (``AGENT_METRICS_PORT``): ``/metrics`` (Prometheus
text), ``/livez`` (the process answers; no dependency) and ``/readyz`` (Redis answers
``PING`` within a second; 503 otherwise). A handful of requests a minute from a scraper and
a probe: one small asyncio server, nothing else (a request head is read up to 8 KiB and
5 s; anything else is 404 / 405 / 400).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)
MAX_HEAD = 8192


class HealthServer:
    def __init__(
        self,
        *,
        render_metrics: Callable[[], bytes],
        ready: Callable[[], Awaitable[bool]],
    ) -> None:
        self.render_metrics = render_metrics
        self.ready = ready
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen; returns the port (useful with port 0)."""
        self._server = await asyncio.start_server(self._serve, host, port)
        bound: int = self._server.sockets[0].getsockname()[1]
        log.info("metrics and health on http://%s:%d/metrics, /livez, /readyz", host, bound)
        return bound

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=5)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, OSError):
            writer.close()
            return
        parts = head[:MAX_HEAD].split(b"\r\n", 1)[0].split()
        status, body, kind = await self._answer(parts)
        writer.write(
            f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n".encode()
            + body
        )
        with contextlib.suppress(OSError):
            await writer.drain()
        writer.close()

    async def _answer(self, parts: list[bytes]) -> tuple[str, bytes, str]:
        text = "text/plain; charset=utf-8"
        if len(parts) != 3:
            return "400 Bad Request", b"bad request\n", text
        method, target = parts[0], parts[1].split(b"?", 1)[0]
        if method != b"GET":
            return "405 Method Not Allowed", b"GET only\n", text
        if target == b"/livez":
            return "200 OK", b"ok\n", text
        if target == b"/readyz":
            if await self.ready():
                return "200 OK", b"ready\n", text
            return "503 Service Unavailable", b"redis unreachable\n", text
        if target == b"/metrics":
            return "200 OK", self.render_metrics(), "text/plain; version=0.0.4; charset=utf-8"
        return "404 Not Found", b"not found\n", text


def redis_ready(redis: object) -> Callable[[], Awaitable[bool]]:
    """``PING`` within a second."""

    async def ready() -> bool:
        try:
            return bool(await asyncio.wait_for(redis.ping(), timeout=1.0))  # type: ignore[attr-defined]
        except Exception:
            return False

    return ready
