"""A deadline for every request that is not meant to wait: a Redis that stops answering
(frozen, or busy with a long command) gets the client a 503 to retry, not a hang.

Exempt are the routes that wait by design: the event streams (SSE), a send with
``?wait=``, and the OpenAI-compatible completions (they wait for the model, bounded by
``AGENT_GATEWAY_WAIT_MAX_S``); WebSockets are not HTTP requests. A response that has begun
when the deadline passes is cut (the connection closes)."""

from __future__ import annotations

import asyncio
from urllib.parse import parse_qs

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send


def waits(scope: Scope) -> bool:
    """Whether a request is one that waits by design."""
    path = scope.get("path", "")
    if path.endswith("/events") or path == "/v1/chat/completions":
        return True
    # ?wait= lifts it on the one route that takes it (a send), not on any other route
    if scope.get("method") != "POST" or not path.endswith("/messages"):
        return False
    # the route reads the last of a repeated parameter: so does this (with ?wait=5&wait=0
    # the deadline was lifted from a send that did not wait)
    query = parse_qs((scope.get("query_string") or b"").decode("latin-1"), keep_blank_values=True)
    try:
        return float(query.get("wait", ["0"])[-1]) > 0
    except ValueError:
        return False  # (refused by the route as invalid)


class Deadline:
    def __init__(self, app: ASGIApp, timeout_s: float) -> None:
        self.app, self.timeout_s = app, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or waits(scope):
            await self.app(scope, receive, send)
            return
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        deadline = asyncio.timeout(self.timeout_s)
        try:
            async with deadline:
                await self.app(scope, receive, sending)
        except TimeoutError:
            if not deadline.expired():
                raise  # not ours
            if not started:
                detail = {"detail": "the message store did not answer in time; try again"}
                await JSONResponse(detail, 503)(scope, receive, send)
