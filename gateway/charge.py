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

A body costs a token more for each ``BODY_COST_BYTES`` (a 1 MiB body: 17), or for each
``BODY_COST_VALUES`` JSON values in it when that is more (at most the burst): parsing and
checking a body costs the event loop by the values in it, and one user sending 1 MiB
bodies of 70,000 tiny metadata entries at 10 a second, within a rate counted in requests,
kept a core busy and another user's p50 went from 0.6 to ~100 ms; 349,000 empty lists in
1 MiB cost 450 ms each (helpers' attacks, stop 52). By its Content-Length here, before
it is read; once read (``BodyLimit``, before the route parses it) the rest: a body sent
in chunks without one, and one of many small values (counted by its ``[``, ``{`` and
``,``, a scan of the bytes).
"""

from __future__ import annotations

import re

from fastapi import HTTPException
from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

FREE = ("/livez", "/readyz", "/metrics", "/favicon.ico")  # no credentials, no Redis work
BODY_COST_BYTES = 64 << 10  # a body costs a token more for each of these
BODY_COST_VALUES = 4096  # ... or of these JSON values (~5 ms of parsing), when more


_STRINGS = re.compile(rb'"(?:[^"\\]+|\\.)*"')  # a JSON string (what is in it is no value)


def body_cost(size: int, values: int = 0) -> int:
    """The tokens a request with a body of ``size`` bytes (``values`` JSON values) costs."""
    return 1 + max(max(0, size) // BODY_COST_BYTES, values // BODY_COST_VALUES)


def json_values(body: bytes) -> int:
    """About how many JSON values ``body`` holds: its ``[``, ``{`` and ``,`` outside strings
    (a text full of commas is one value; its strings are taken out only when the commas
    are many: a scan at C speed, ~2 ms for 1 MiB of values)."""
    count = body.count(b"[") + body.count(b"{") + body.count(b",")
    if count < BODY_COST_VALUES:
        return count
    bare = _STRINGS.sub(b'""', body)
    return bare.count(b"[") + bare.count(b"{") + bare.count(b",")


async def charge_rest(scope: Scope, body: bytes) -> HTTPException | None:
    """A body read whole: what the request was not charged for yet (it was sent in
    chunks, without a Content-Length, or it holds many small values); the 429 to answer,
    if refused."""
    state = scope.get("state") or {}
    charged = state.get("charged")
    if charged is None:
        return None
    auth = scope["app"].state.gw.auth
    first = state.get("charged_cost", 1)
    # the whole request costs at most the burst: else it would never be admitted
    cost = min(body_cost(len(body), json_values(body)), max(first, auth.rate.burst))
    extra = cost - first
    if extra <= 0:
        return None
    state["charged_cost"] = cost
    try:
        await auth.charge(charged[0], extra)
    except HTTPException as exc:
        auth.rate.refund(charged[0].hash, first)  # (asked again, it pays again)
        return exc
    return None


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
            length = dict(scope.get("headers") or []).get(b"content-length", b"")
            size = int(length) if length.isdigit() else 0  # (over the limit: BodyLimit's)
            cost = body_cost(size)
            try:
                await auth.charge(user, cost)
            except HTTPException as exc:
                await refuse(exc, scope, receive, send)
                return
            state = scope.setdefault("state", {})
            state["charged"], state["charged_cost"] = (user, by_ticket), cost
        await self.app(scope, receive, send)


async def refuse(exc: HTTPException, scope: Scope, receive: Receive, send: Send) -> None:
    """A 429 with ``Connection: close`` (requests pipelined behind it go with it)."""
    headers = {**(exc.headers or {}), "Connection": "close"}
    response = JSONResponse({"detail": exc.detail}, exc.status_code, headers)
    await response(scope, receive, send)
