"""Each HTTP request is charged to its user before anything else is done for it.

A route's own dependencies run after FastAPI has read and decoded the body: a user past
the rate (gateway.ratelimit) could still get an instant 422 for a body that is not JSON,
404 or 405, as fast as it asked. Here, outside the body limit, a request that carries a
user's credentials (a bearer token, a trusted proxy's header, or a ticket) waits for a
token of that user's, or gets 429 with ``Connection: close`` (requests pipelined behind it
on the connection are dropped with it, not queued at ~20 a second). The route's own
authentication then takes the user found here (``scope["state"]``; one found by a
ticket only where the route accepts tickets) and does not charge it again; a request without credentials goes on to the route's 401 (it costs no
Redis work; a flood of them is for the reverse proxy in front, docs/SECURITY.md).
"""

from __future__ import annotations

from fastapi import HTTPException
from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

FREE = ("/livez", "/readyz", "/metrics", "/favicon.ico")  # no credentials, no Redis work


class Charge:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in FREE or scope["path"] == "/":
            await self.app(scope, receive, send)
            return
        auth = scope["app"].state.gw.auth
        if auth.rate.rate <= 0:  # no rate (AGENT_GATEWAY_USER_RATE=0): nothing to charge
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        user = await auth.identify(request)
        by_ticket = user is None
        if user is None:
            user = await auth.identify(request, ticket_ok=True)
        if user is not None:
            try:
                await auth.charge(user)
            except HTTPException as exc:
                headers = {**(exc.headers or {}), "Connection": "close"}
                response = JSONResponse({"detail": exc.detail}, exc.status_code, headers)
                await response(scope, receive, send)
                return
            scope.setdefault("state", {})["charged"] = (user, by_ticket)
        await self.app(scope, receive, send)
