"""Who is asking: bearer tokens, a trusted proxy's header, or a short-lived ticket.

Default deny: a request with none of them is answered 401. Tickets exist because
``EventSource`` and browser WebSockets cannot send headers: an authenticated call mints
one (kept in Redis, so any replica accepts it) and the stream URL carries it.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
import secrets
from dataclasses import dataclass

from fastapi import HTTPException, Request, WebSocket
from redis.asyncio import Redis

from bus_redis.codec import text
from bus_redis.keys import Keys
from gateway.settings import GatewaySettings

USER_RE = re.compile(r"[^\x00-\x1f\x7f]{1,256}")
TICKET_RE = re.compile(r"[A-Za-z0-9_-]{20,64}")


@dataclass(frozen=True, slots=True)
class User:
    """An authenticated user. ``hash`` names the user in keys, chat ids and the scope
    the gateway vouches for (the id itself never appears in a key)."""

    id: str

    @property
    def hash(self) -> str:
        return hashlib.sha256(self.id.encode()).hexdigest()[:24]


class Authenticator:
    def __init__(self, settings: GatewaySettings, redis: Redis) -> None:
        self.settings = settings
        self.redis = redis
        self.keys = Keys(settings.key_prefix)
        # compared by digest: a lookup never depends on how much of a token matched
        self._tokens = {_digest(t): u for t, u in settings.all_tokens().items()}
        self._proxies = [ipaddress.ip_network(p, strict=False) for p in settings.trusted_proxies]

    @property
    def configured(self) -> bool:
        return bool(self._tokens or self._proxies)

    async def user(self, request: Request | WebSocket, *, ticket_ok: bool = False) -> User:
        """The caller, or HTTP 401."""
        found = self._from_proxy(request) or self._from_bearer(request)
        if found is None and ticket_ok:
            found = await self._from_ticket(request.query_params.get("ticket", ""))
        if found is None or not USER_RE.fullmatch(found):
            raise HTTPException(401, "authentication required", {"WWW-Authenticate": "Bearer"})
        return User(found)

    def _from_proxy(self, request: Request | WebSocket) -> str | None:
        value = request.headers.get(self.settings.user_header)
        if not value or not self._proxies or request.client is None:
            return None
        try:
            peer = ipaddress.ip_address(request.client.host)
        except ValueError:
            return None
        return value if any(peer in net for net in self._proxies) else None

    def _from_bearer(self, request: Request | WebSocket) -> str | None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            return None
        return self._tokens.get(_digest(token.strip()))

    async def mint_ticket(self, user: User) -> str:
        ticket = secrets.token_urlsafe(24)
        key = self.keys.gw_ticket(self.settings.channel, ticket)
        await self.redis.set(key, user.id, ex=self.settings.ticket_ttl_s)
        return ticket

    async def _from_ticket(self, ticket: str) -> str | None:
        """A ticket is good for its lifetime (an EventSource may reconnect with it)."""
        if not TICKET_RE.fullmatch(ticket):
            return None
        raw = await self.redis.get(self.keys.gw_ticket(self.settings.channel, ticket))
        return text(raw) if raw is not None else None


def _digest(token: str) -> bytes:
    return hmac.digest(b"agent-gateway", token.encode(), "sha256")
