"""Who is asking: bearer tokens, a trusted proxy's header, or a short-lived ticket.

Default deny: a request with none of them is answered 401. Tickets exist because
``EventSource`` and browser WebSockets cannot send headers: an authenticated call mints
one and the stream URL carries it. A ticket is signed, not stored (``Tickets``): minting
any number of them holds no memory anywhere, checking one (or a forged one) costs no
Redis call, and any replica accepts it (the key is the channel's, in Redis).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import logging
import math
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import HTTPException, Request, WebSocket
from redis.asyncio import Redis

from bus_redis.codec import text
from bus_redis.keys import Keys
from gateway.ratelimit import UserRate
from gateway.settings import GatewaySettings

USER_RE = re.compile(r"[^\x00-\x1f\x7f]{1,256}")
# <expiry, epoch s in base 36>.<user id, base64url>.<HMAC-SHA256, 16 bytes, base64url>;
# a user id is 256 characters at most (USER_RE): 1,024 bytes of UTF-8, 1,366 in base64url
TICKET_RE = re.compile(r"([0-9a-z]{1,12})\.([A-Za-z0-9_-]{2,1366})\.([A-Za-z0-9_-]{22})")
KEY_REFRESH_S = 1.0  # an unknown signature re-reads the channel's key at most this often


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
        self._users = set(self._tokens.values())
        self._proxies = [ipaddress.ip_network(p, strict=False) for p in settings.trusted_proxies]
        self.tickets = Tickets(redis, self.keys.gw_ticket_secret(settings.channel), settings)
        self.rate = UserRate(settings.user_rate, settings.user_burst)

    @property
    def configured(self) -> bool:
        return bool(self._tokens or self._proxies)

    async def user(self, request: Request | WebSocket, *, ticket_ok: bool = False) -> User:
        """The caller, or HTTP 401; slowed down, or HTTP 429, when the caller asks too often
        (``charge``: once a request; gateway.charge charges HTTP requests first)."""
        # (user, by a ticket) that gateway.charge found and charged for this request
        charged = getattr(request, "scope", {}).get("state", {}).get("charged")
        if charged is not None and (ticket_ok or not charged[1]):
            return charged[0]
        user = await self.identify(request, ticket_ok=ticket_ok)
        if user is None:
            raise HTTPException(401, "authentication required", {"WWW-Authenticate": "Bearer"})
        if charged is None or charged[0] != user:
            await self.charge(user)
        return user

    async def identify(
        self, request: Request | WebSocket, *, ticket_ok: bool = False
    ) -> User | None:
        """Who the credentials name, if anyone (nothing charged, nothing refused)."""
        found = self._from_proxy(request) or self._from_bearer(request)
        if found is None and ticket_ok:
            found = await self._from_ticket(request.query_params.get("ticket", ""))
        if found is None or not USER_RE.fullmatch(found):
            return None
        return User(found)

    async def charge(self, user: User, cost: float = 1.0) -> None:
        """One request of ``user``'s (gateway.ratelimit; ``cost`` tokens, a large body's
        more): waits for its tokens, or raises HTTP 429 with Retry-After (after waiting
        too)."""
        if not await self.rate.wait(user.hash, cost):
            raise HTTPException(
                429,
                f"too many requests: {self.rate.rate:g} a second at most, "
                f"{self.rate.burst} at once",
                {
                    "Retry-After": str(
                        min(3600, max(1, math.ceil(self.rate.retry_after_s(user.hash, cost))))
                    )
                },
            )

    def _from_proxy(self, request: Request | WebSocket) -> str | None:
        # exactly one: a proxy that appends its header (instead of replacing the client's)
        # leaves the client's own first, and two values name nobody for sure
        values = request.headers.getlist(self.settings.user_header)
        value = values[0] if len(values) == 1 else None
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
        return await self.tickets.mint(user.id)

    async def _from_ticket(self, ticket: str) -> str | None:
        """The ticket's user while it is good: signed by this channel's key, not expired,
        and (when users come from tokens only) still one of the configured users, so a
        ticket does not outlive its user's token."""
        user = await self.tickets.check(ticket)
        if user is None or (not self._proxies and user not in self._users):
            return None
        return user


class Tickets:
    """Signed, stateless tickets: ``<expiry>.<user id>.<HMAC>`` under a random key that
    the channel's replicas share (``P:{C}:gw:ticket:secret``, made by whichever replica
    needs it first). A ticket is good for any number of uses until it expires (an
    EventSource reconnects with its URL); the page mints a new one per connection. The
    gateway's log never shows one (:class:`RedactTickets`)."""

    def __init__(
        self,
        redis: Redis,
        key: str,
        settings: GatewaySettings,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.redis = redis
        self.key = key
        self.channel = settings.channel
        self.ttl_s = settings.ticket_ttl_s
        self.clock = clock
        self._secret: bytes | None = None
        self._read_at = float("-inf")

    async def mint(self, user_id: str) -> str:
        secret = await self._load()  # (a key re-made after a Redis flush is picked up)
        expiry = _base36(int(self.clock()) + self.ttl_s)
        user = base64.urlsafe_b64encode(user_id.encode()).decode().rstrip("=")
        return f"{expiry}.{user}.{self._sign(secret, expiry, user)}"

    async def check(self, ticket: str) -> str | None:
        """The user a good ticket names, else None; a Redis call at most once a
        ``KEY_REFRESH_S`` (a signature this replica cannot check: the key may be new)."""
        found = TICKET_RE.fullmatch(ticket)
        if found is None:
            return None
        expiry, user, mac = found.groups()
        if int(expiry, 36) < self.clock():
            return None
        secret = self._secret
        if secret is None or not hmac.compare_digest(mac, self._sign(secret, expiry, user)):
            if self.clock() - self._read_at < KEY_REFRESH_S:
                return None
            secret = await self._load()
            if not hmac.compare_digest(mac, self._sign(secret, expiry, user)):
                return None
        try:
            return base64.urlsafe_b64decode(user + "=" * (-len(user) % 4)).decode()
        except ValueError:  # (signed by us: cannot happen)
            return None

    async def _load(self) -> bytes:
        """The channel's key: made here when there is none (``SET NX GET``, one call)."""
        mine = secrets.token_hex(32)
        theirs = await self.redis.set(self.key, mine, nx=True, get=True)
        self._secret = (text(theirs) if theirs is not None else mine).encode()
        self._read_at = self.clock()
        return self._secret

    def _sign(self, secret: bytes, expiry: str, user: str) -> str:
        msg = f"{self.channel}.{expiry}.{user}".encode()
        digest = hmac.digest(secret, msg, "sha256")[:16]
        return base64.urlsafe_b64encode(digest).decode().rstrip("=")


class RedactTickets(logging.Filter):
    """Keeps tickets out of the log: uvicorn logs every WebSocket's URL (``?ticket=``)
    even with its access log off. Installed on uvicorn's loggers by ``create_app``."""

    PATTERN = re.compile(r"(ticket=)[^&\s\"']+")

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "ticket=" in message:
            record.msg, record.args = self.PATTERN.sub(r"\1[redacted]", message), ()
        return True

    @classmethod
    def install(cls) -> None:
        for name in ("uvicorn.error", "uvicorn.access"):
            logger = logging.getLogger(name)
            if not any(isinstance(f, cls) for f in logger.filters):
                logger.addFilter(cls())


def _base36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if not n:
            return out


def _digest(token: str) -> bytes:
    return hmac.digest(b"agent-gateway", token.encode(), "sha256")
