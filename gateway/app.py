"""The gateway application: wiring of Redis, auth, chats and the event hub.

create_app(settings)
  ├── Gateway            one per process (app.state.gw)
  │     ├── redis        a bounded, blocking connection pool (AGENT_GATEWAY_REDIS_CONNECTIONS)
  │     ├── FrontendClient   publish messages and controls (bus_redis, wire v2)
  │     ├── Authenticator    tokens / trusted proxy / tickets      (auth.py)
  │     ├── Backlog          what one user may leave waiting        (backlog.py)
  │     ├── Chats            ids, ownership, status, history       (chats.py)
  │     └── EventHub         one blocking read for every open stream (hub.py)
  ├── api.router         JSON API and SSE                           (api.py)
  ├── ws.router          one WebSocket, many sessions                (ws.py)
  └── openai_compat.router   POST /v1/chat/completions            (openai_compat.py)
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import secrets
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from redis.asyncio import BlockingConnectionPool, Redis
from redis.exceptions import RedisError

from bus_redis import FrontendClient, InboundMessage, OutboundMessage
from bus_redis.keys import Keys
from gateway.auth import Authenticator, RedactTickets, User
from gateway.backlog import Backlog, TooLargeError
from gateway.bodylimit import BodyLimit
from gateway.charge import Charge
from gateway.chats import Chat, Chats, end_user_of
from gateway.deadline import Deadline
from gateway.errors import invalid, redis_failed
from gateway.health import Readiness
from gateway.hub import EventHub, TooManyStreamsError
from gateway.metrics import GatewayMetrics, RequestMetrics
from gateway.origin import SameOrigin
from gateway.settings import GatewaySettings
from gateway.subscription import Subscription

log = logging.getLogger(__name__)


@dataclass
class Gateway:
    settings: GatewaySettings
    redis: Redis
    readers: list[Redis]
    replica: str = field(default_factory=lambda: secrets.token_hex(6))

    def __post_init__(self) -> None:
        s = self.settings
        self.keys = Keys(s.key_prefix)
        self.client = FrontendClient(self.redis, s.key_prefix, followup=s.followup)
        self.auth = Authenticator(s, self.redis)
        self.readiness = Readiness(self.redis)
        self.backlog = Backlog(
            self.redis,
            self.client,
            self.keys,
            s.channel,
            per_chat=s.max_waiting_per_chat,
            chats=s.max_waiting_chats_per_user,
        )
        self.chats = Chats(
            self.redis,
            self.keys,
            s.channel,
            max_per_user=s.max_sessions_per_user,
            max_temporary=s.max_temporary_per_user,
            expire_after_ms=int(s.session_ttl_s * 1000),
        )
        self._user_streams: Counter[str] = Counter()
        self._user_sockets: Counter[str] = Counter()
        self.metrics = GatewayMetrics()
        self.hub = EventHub(
            self.readers,
            self.redis,
            self.keys,
            channel=s.channel,
            wake_key=self.keys.gw_wake(s.channel, self.replica),
            max_streams=s.max_streams,
        )

    def message(self, user: User, chat: Chat, content: str, **fields: object) -> InboundMessage:
        """The inbound message for a user's chat. Everything that decides where it runs
        and whose it is comes from here, never from the client: the session, the scope
        (the user; a bot's end user's chat, the end user's, counted as the user's own
        against the per-scope limits), ``require_existing_session`` and
        ``session_key_override``."""
        scope, quota = f"user-{user.hash}", None
        end_user = end_user_of(chat.id)
        if end_user is not None:  # (the page, or X-Session-Id, continuing such a chat)
            scope, quota = f"{scope}-oa-{end_user}", scope
        return InboundMessage(
            channel=self.settings.channel,
            sender_id=user.id,
            chat_id=chat.id,
            content=content,
            scope=scope,
            quota=quota,
            require_existing_session=chat.temporary,
            session_key_override=chat.session_key if chat.temporary else None,
            **fields,  # type: ignore[arg-type]
        )

    def has_room(self, user: User, chat: Chat) -> bool:
        return self._user_streams[
            user.hash
        ] < self.settings.max_streams_per_user and self.hub.has_room(chat.session_key)

    @contextmanager
    def socket_slot(self, user: User) -> Iterator[bool]:
        """One of the user's WebSockets on this process: False when they hold
        ``max_sockets_per_user`` already (an idle socket costs the process memory and a
        task, and subscribing nothing it escapes the streams' bound)."""
        if self._user_sockets[user.hash] >= self.settings.max_sockets_per_user:
            yield False
            return
        self._user_sockets[user.hash] += 1
        try:
            yield True
        finally:
            self._user_sockets[user.hash] -= 1
            if self._user_sockets[user.hash] <= 0:
                del self._user_sockets[user.hash]

    @asynccontextmanager
    async def subscribe(self, user: User, chat: Chat, after: str) -> AsyncIterator[Subscription]:
        """Follow a chat's events for a user: at most ``max_streams_per_user`` at once per
        process (so one user cannot take every stream of a replica)."""
        if self._user_streams[user.hash] >= self.settings.max_streams_per_user:
            raise TooManyStreamsError(f"{self.settings.max_streams_per_user} streams per user")
        self._user_streams[user.hash] += 1
        self.metrics.streams_open.inc()
        try:
            async with self.hub.subscribe(chat.session_key, after, user.hash) as sub:
                yield sub
        finally:
            self.metrics.streams_open.dec()
            self._user_streams[user.hash] -= 1
            if self._user_streams[user.hash] <= 0:
                del self._user_streams[user.hash]

    async def publish(self, user: User, chat: Chat, msg: InboundMessage) -> set[str]:
        """Send to the user's chat, within the workers' payload limit (``TooLargeError``),
        the user's backlog (``BacklogFullError``) and while the chat is theirs
        (``ChatGoneError``); a durable chat without a title takes
        the message's first line. Returns the ids its terminal event may answer to: the
        message id, and the entry id for a payload the worker cannot read that far."""
        if msg.followup is None and self.client.followup is not None:  # as it is sent
            msg = msg.model_copy(update={"followup": self.client.followup})
        size = len(msg.model_dump_json(exclude_none=True).encode())
        if size > self.settings.max_payload_bytes:
            limit = self.settings.max_payload_bytes
            raise TooLargeError(f"the message is {size} bytes as sent, at most {limit}")
        title = self.chats.title_for(chat, msg.content)
        async with self.backlog.serialized(user):
            guard = self.backlog.guard(user, chat, title=title)
            entry_id = await self.client.send_entry(msg, guard=guard)
        chat.title = chat.title or title
        self.metrics.messages_published.inc()
        return {msg.id or entry_id, entry_id}

    async def control(self, user: User, chat: Chat, op: str, *, forget: bool = False) -> None:
        """A stop, discard, new or delete of the user's chat, guarded as :meth:`publish`;
        ``forget``: the chat leaves the user's lists in the same transaction (a durable
        chat never used needs no marker: it only leaves them)."""
        async with self.backlog.serialized(user):
            if forget and not chat.temporary and await self.backlog.forget_unused(user, chat):
                return
            guard = self.backlog.guard(user, chat, control=True, forget=forget)
            await self.client.control(op, chat.session_key, guard=guard)

    async def open_temporary(self, user: User) -> Chat:
        """A new temporary chat, opened on the workers; the user's oldest past
        ``max_temporary_per_user`` are discarded in the same transaction."""
        chat = self.chats.mint_temporary(user)
        async with self.backlog.serialized(user):
            guard = self.backlog.opening(user, chat, self.settings.max_temporary_per_user)
            await self.client.open_transient(
                self.settings.channel,
                chat.id,
                session_key=chat.session_key,
                disabled_tools=self.settings.temporary_disabled_tools,
                scope=f"user-{user.hash}",
                guard=guard,
            )
        for key in guard.evicted:  # their running turns end now (their markers are written)
            await self.client.announce("discard", key)
        return chat

    async def wait_terminal(
        self, user: User, chat: Chat, reply_to: set[str], after: str, timeout_s: float
    ) -> OutboundMessage | None:
        """The terminal event answering ``reply_to`` after cursor ``after``, or None."""

        async def find() -> OutboundMessage | None:
            async with self.subscribe(user, chat, after) as sub:
                async for ev in sub.events(timeout_s):
                    e = ev.event if ev is not None else None
                    if (
                        e is not None
                        and e.is_terminal
                        and (answers(e, reply_to) or (chat.temporary and e.is_loss_notice))
                    ):
                        return e  # (a loss notice: the answer may be gone with the session)
            return None

        try:
            return await asyncio.wait_for(find(), timeout_s)
        except TimeoutError:
            return None

    async def close(self) -> None:
        await self.hub.stop()
        for reader in self.readers:
            await reader.aclose()
        await self.client.aclose()
        await self.redis.aclose()


def answers(ev: OutboundMessage, ids: set[str]) -> bool:
    """Whether event ``ev`` is about one of the message ids ``ids``."""
    return ev.reply_to in ids or not ids.isdisjoint(ev.covers or [])


def make_gateway(settings: GatewaySettings) -> Gateway:
    pool = BlockingConnectionPool.from_url(
        settings.redis_url, max_connections=settings.redis_connections, timeout=10
    )
    readers = [
        Redis(
            connection_pool=BlockingConnectionPool.from_url(
                settings.redis_url, max_connections=1, timeout=10
            )
        )
        for _ in range(settings.readers)
    ]
    return Gateway(settings, Redis(connection_pool=pool), readers)


def create_app(settings: GatewaySettings, gateway: Gateway | None = None) -> FastAPI:
    from gateway import api, openai_compat, ws

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        gw = gateway or make_gateway(settings)
        gw.metrics = app.state.metrics
        if not gw.auth.configured:
            log.warning("no tokens and no trusted proxies configured: every request is refused")
        gw.hub.start()
        app.state.gw = gw
        try:
            yield
        finally:
            await gw.close()

    app = FastAPI(
        title="redis-agent-worker gateway",
        version="2",
        summary="HTTP, SSE and WebSocket front door of redis-agent-worker (wire v2).",
        lifespan=lifespan,
        # no /docs or /redoc: FastAPI's load their scripts from a CDN by floating version,
        # on the origin whose localStorage holds the page's token (/openapi.json stays)
        docs_url=None,
        redoc_url=None,
    )
    app.add_middleware(Deadline, timeout_s=settings.request_timeout_s)  # (after the body)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes, timeout_s=settings.body_timeout_s)
    app.add_middleware(Charge)  # (before the body is read)
    if settings.trusted_proxies:  # credentials a browser sends by itself (a proxy's
        # login cookie turned into the user header): another site's page is refused
        # before anything is charged or read. Bearer tokens and tickets are never sent
        # by a browser on its own, so without a trusted proxy there is nothing to refuse
        app.add_middleware(
            SameOrigin,
            allowed=settings.allowed_origins,
            proxies=[ipaddress.ip_network(p, strict=False) for p in settings.trusted_proxies],
        )
    metrics = gateway.metrics if gateway is not None else GatewayMetrics()
    app.add_middleware(RequestMetrics, metrics=metrics)
    app.state.metrics = metrics
    app.include_router(api.router)
    app.include_router(ws.router)
    app.include_router(openai_compat.router)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(RedisError, redis_failed)
    RedactTickets.install()

    @app.get("/", include_in_schema=False)
    async def page() -> HTMLResponse:
        html = resources.files("gateway").joinpath("static/index.html").read_text()
        return HTMLResponse(
            html, headers={"Cache-Control": "no-store", "Content-Security-Policy": CSP}
        )

    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon() -> Response:
        return Response(status_code=204)

    @app.get("/livez", include_in_schema=False)
    async def livez() -> Response:
        return Response("ok\n", media_type="text/plain")

    @app.get("/metrics", include_in_schema=False)
    async def metrics_page(request: Request) -> Response:
        if not _may_scrape(request, settings.metrics_networks):
            return Response("not found\n", 404, media_type="text/plain")
        body = request.app.state.metrics.render()
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/readyz", include_in_schema=False)
    async def readyz(request: Request) -> Response:
        if not await request.app.state.gw.readiness.ready():
            return JSONResponse({"ready": False, "reason": "redis unreachable"}, 503)
        return JSONResponse({"ready": True})

    return app


def _may_scrape(request: Request, networks: list[str]) -> bool:
    """Metrics are for the operator's scraper: only clients in ``metrics_networks``."""
    if request.client is None:
        return False
    try:
        peer = ipaddress.ip_address(request.client.host)
    except ValueError:
        return False
    return any(peer in ipaddress.ip_network(n, strict=False) for n in networks)


# the page is self-contained: its own script and style only, no outside origin
CSP = (
    "default-src 'none'; script-src 'self' 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)
