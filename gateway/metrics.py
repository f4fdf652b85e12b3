"""Prometheus metrics of one gateway process, in a registry of its own. Labels are route
templates (``/api/chats/{chat_id}``, never the id itself), methods and status codes."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 120)


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "gateway_requests", "HTTP requests answered, by route template, method and status",
            ["route", "method", "status"], registry=r,
        )  # fmt: skip
        self.request_seconds = Histogram(
            "gateway_request_seconds", "Time to the response's start (streams: to their head)",
            ["route"], buckets=_BUCKETS, registry=r,
        )  # fmt: skip
        self.streams_open = Gauge(
            "gateway_streams_open", "Event subscriptions open (SSE, WebSocket, waits)", registry=r
        )
        self.messages_published = Counter(
            "gateway_messages_published", "Messages published to the workers", registry=r
        )
        self.websockets_open = Gauge(
            "gateway_websockets_open", "WebSocket connections open", registry=r
        )

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))


class RequestMetrics:
    """ASGI middleware: counts each HTTP request by the route template it matched."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        status = [500]

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
                route = _route(scope)
                self.metrics.request_seconds.labels(route).observe(time.monotonic() - started)
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            self.metrics.requests.labels(_route(scope), scope["method"], str(status[0])).inc()


def _route(scope: Scope) -> str:
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else "unmatched"
