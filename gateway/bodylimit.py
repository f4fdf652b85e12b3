"""Every request body read whole, within a size and a time, before a route sees it."""

from __future__ import annotations

import asyncio

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.charge import charge_rest, refuse


class BodyLimit:
    """Every request body is read here, whole, before a route sees it: at most ``limit``
    bytes (413: by its Content-Length, or, in chunks without one, once more has come) and
    within ``timeout_s`` (408: a client that declares a body and trickles it, or stops,
    holds nothing past that). A request without a body passes as it is."""

    def __init__(self, app: ASGIApp, limit: int, timeout_s: float = 30.0) -> None:
        self.app, self.limit, self.timeout_s = app, limit, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            await self._refuse(scope, receive, send, 413, f"request body over {self.limit} bytes")
            return
        if length in (None, b"0") and b"transfer-encoding" not in headers:  # no body
            await self.app(scope, receive, send)
            return
        try:
            async with asyncio.timeout(self.timeout_s):
                body = await self._read(receive)
        except TimeoutError:
            detail = f"request body not received within {self.timeout_s:g} s"
            await self._refuse(scope, receive, send, 408, detail)
            return
        if body is None:  # the client went away
            return
        if len(body) > self.limit:
            await self._refuse(scope, receive, send, 413, f"request body over {self.limit} bytes")
            return
        refused = await charge_rest(scope, body)  # (in chunks, or many values: the rest now)
        if refused is not None:
            await refuse(refused, scope, receive, send)
            return
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _read(self, receive: Receive) -> bytes | None:
        """The body; past the limit, what came so far (no more is read); None when the
        client went away."""
        chunks: list[bytes] = []
        size, more = 0, True
        while more and size <= self.limit:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = bool(message.get("more_body"))
        return b"".join(chunks)

    async def _refuse(
        self, scope: Scope, receive: Receive, send: Send, status: int, detail: str
    ) -> None:
        headers = {"Connection": "close"} if status == 408 else None
        await JSONResponse({"detail": detail}, status, headers=headers)(scope, receive, send)
