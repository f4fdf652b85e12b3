"""SameOrigin: a request a page of another site makes in the user's browser is refused.

Behind an authenticating proxy (a login cookie turned into ``X-Forwarded-User``) the
browser sends the user's credentials with any request to the gateway, whichever page
makes it: a WebSocket handshake (no CORS for WebSockets) or an HTML form's POST (no
preflight). So every WebSocket handshake, every request that is not GET, HEAD or
OPTIONS, and every GET of an event stream (``.../events``: an ``<img>`` or an
``EventSource`` of another site's page opens it in the user's name and holds one of the
user's stream slots, though the browser hides the answer) must come from the gateway's
own origin, or one the operator lists
(``AGENT_GATEWAY_ALLOWED_ORIGINS``), when the browser says where it comes from:

- ``Origin`` (browsers send it with every cross-origin request and every POST and
  WebSocket): its host (and port) must be the request's ``Host``, or the host a trusted
  proxy names in ``X-Forwarded-Host``, or the origin must be listed; ``null`` (a
  sandboxed frame, a file) never is;
- without ``Origin``, ``Sec-Fetch-Site: cross-site`` is refused.

A client that is no browser sends neither header and is not concerned (its credentials
are its own). Refused: HTTP 403, or the WebSocket closed before it is accepted.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from urllib.parse import urlsplit

from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Receive, Scope, Send

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


class SameOrigin:
    def __init__(
        self,
        app: ASGIApp,
        *,
        allowed: Iterable[str] = (),
        proxies: Iterable[ipaddress.IPv4Network | ipaddress.IPv6Network] = (),
    ) -> None:
        self.app = app
        self.allowed = frozenset(o.rstrip("/").lower() for o in allowed)
        self.proxies = tuple(proxies)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        checked = kind == "websocket" or (
            kind == "http"
            and (scope["method"] not in SAFE_METHODS or scope.get("path", "").endswith("/events"))
        )
        if not checked or self._same_site(scope):
            await self.app(scope, receive, send)
            return
        if kind == "websocket":
            await send({"type": "websocket.close", "code": 4403, "reason": "cross-site"})
            return
        refusal = PlainTextResponse("refused: a request of another site's page", 403)
        await refusal(scope, receive, send)

    def _same_site(self, scope: Scope) -> bool:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        origin = headers.get("origin")
        if origin is None:
            return headers.get("sec-fetch-site", "") != "cross-site"
        origin = origin.strip().rstrip("/").lower()
        if origin in self.allowed:
            return True
        host = urlsplit(origin).netloc
        if not host or origin == "null":
            return False
        hosts = {headers.get("host", "").strip().lower()}
        if self._from_proxy(scope):
            forwarded = headers.get("x-forwarded-host", "")
            hosts |= {h.strip().lower() for h in forwarded.split(",") if h.strip()}
        return host in hosts

    def _from_proxy(self, scope: Scope) -> bool:
        client = scope.get("client")
        if not client or not self.proxies:
            return False
        try:
            peer = ipaddress.ip_address(client[0])
        except ValueError:
            return False
        return any(peer in net for net in self.proxies)
