"""``agent-gateway``: serve the HTTP/SSE/WebSocket front door and the chat page."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys

from pydantic import ValidationError

from bus_redis.config import package_version
from gateway.settings import GatewaySettings

EPILOG = """\
configuration (environment; options override):
  AGENT_REDIS_URL / AGENT_GATEWAY_REDIS_URL   Redis URL, as the channel's gateway ACL user
  AGENT_KEY_PREFIX / AGENT_GATEWAY_KEY_PREFIX key prefix (default agent)
  AGENT_GATEWAY_HOST / AGENT_GATEWAY_PORT     where it listens (127.0.0.1 / 8080)
  AGENT_GATEWAY_CHANNEL                       the channel served (default web)
  AGENT_GATEWAY_FOLLOWUP                      double texting for messages naming none: inject,
                                              queue, interrupt or reject (default: the workers')
  AGENT_GATEWAY_TOKENS                        token=user,token2=user2 (bearer tokens)
  AGENT_GATEWAY_TOKENS_FILE                   a file of 'TOKEN USER' lines
  AGENT_GATEWAY_TRUSTED_PROXIES               addresses/networks whose user header is believed
  AGENT_GATEWAY_USER_HEADER                   that header (default X-Forwarded-User)
  AGENT_GATEWAY_ALLOWED_ORIGINS               other origins (scheme://host[:port]) whose pages
                                              may post and open WebSockets; another site's
                                              are refused (403)
  AGENT_GATEWAY_METRICS_NETWORKS              who may read /metrics (127.0.0.1/32,::1/128)
  AGENT_GATEWAY_TICKET_TTL_S                  lifetime of EventSource/WebSocket tickets (60)
  AGENT_GATEWAY_MAX_SESSIONS_PER_USER         durable chats per user (500)
  AGENT_GATEWAY_MAX_TEMPORARY_PER_USER        open temporary chats per user (5; more discards
                                              the oldest)
  AGENT_GATEWAY_SESSION_TTL_S                 a chat whose session the workers no longer
                                              store leaves its user's list this long after
                                              its creation (7776000; 0: kept)
  AGENT_GATEWAY_MAX_WAITING_PER_CHAT          entries one chat may have waiting for the
                                              workers (10; more: 429)
  AGENT_GATEWAY_MAX_WAITING_CHATS_PER_USER    chats of one user with entries waiting (8)
  AGENT_GATEWAY_USER_RATE                     requests (and WebSocket messages) of one user a
                                              second on this replica (20; past it a request
                                              waits up to 1 s, else 429; 0: no limit)
  AGENT_GATEWAY_USER_BURST                    ... and how many may be saved up (100)
  AGENT_GATEWAY_MAX_STREAMS                   open event streams per process (10000)
  AGENT_GATEWAY_MAX_STREAMS_PER_USER          ... of them for one user (64)
  AGENT_GATEWAY_MAX_SOCKETS_PER_USER          open WebSockets of one user per process (16;
                                              more: closed with 4429)
  AGENT_GATEWAY_MAX_BODY_BYTES                a request body (1048576)
  AGENT_GATEWAY_MAX_PAYLOAD_BYTES             a message as published, as the workers'
                                              AGENT_MAX_PAYLOAD_BYTES (262144; more: 413)
  AGENT_GATEWAY_BODY_TIMEOUT_S                to receive a request body whole (30; later: 408)
  AGENT_GATEWAY_REQUEST_TIMEOUT_S             to answer a request that does not wait by
                                              design (10; later: 503)
  AGENT_GATEWAY_REDIS_CONNECTIONS             pooled Redis connections per process (16)
  AGENT_GATEWAY_READERS                       blocking event reads sharing the open streams (8),
                                              one connection each
  AGENT_GATEWAY_TEMPORARY_DISABLED_TOOLS      tools a temporary chat never gets
                                              (create_goal,update_goal,spawn,cron)
  AGENT_GATEWAY_KEEPALIVE_S                   an event stream's keep-alive comment (15)
  AGENT_GATEWAY_SSE_RETRY_MS                  an EventSource's reconnect delay (2000)
  AGENT_GATEWAY_WAIT_MAX_S                    the longest ?wait= or completion wait (120)
  AGENT_GATEWAY_HISTORY_LIMIT                 the most messages a history read gives (200)
  AGENT_GATEWAY_LOG_LEVEL                     log level (INFO)
With no token and no trusted proxy configured every request is refused (401);
a token shorter than 12 characters, or a trusted proxy network of every address,
refuses to start (exit 2).
Generate the Redis user with: agent-worker acl gateway --channel C --password PW
"""


WS_MAX_FRAME_BYTES = 64 * 1024  # uvicorn refuses a larger WebSocket frame before reading it
MIN_TOKEN_CHARS = 12  # shorter tokens are refused at start


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="agent-gateway",
        description="HTTP/SSE/WebSocket gateway and chat page for redis-agent-worker "
        "(a frontend of one channel; run any number of replicas behind any load balancer).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8080)")
    p.add_argument("--channel", help="the channel this gateway serves (default web)")
    p.add_argument("--redis-url", help="Redis URL (default redis://localhost:6379/0)")
    p.add_argument("--prefix", dest="key_prefix", help="key prefix (default agent)")
    p.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    return p


def unknown_variables(environ: dict[str, str]) -> list[str]:
    """``AGENT_GATEWAY_*`` variables no gateway setting reads (a typo changes nothing),
    whatever the case of their names (settings are read so)."""
    known = {f"AGENT_GATEWAY_{name.upper()}" for name in GatewaySettings.model_fields}
    return sorted(
        n for n in environ if n.upper().startswith("AGENT_GATEWAY_") and n.upper() not in known
    )


def unsafe_settings(settings: GatewaySettings) -> str | None:
    """What makes ``settings`` unsafe to serve with (None: nothing): a token short enough
    to guess (requests without credentials are not rate limited), or a trusted proxy
    network that is everyone (any client could then name its own user)."""
    for token in settings.all_tokens():
        if len(token) < MIN_TOKEN_CHARS:
            return (
                f"a token of {len(token)} characters (at least {MIN_TOKEN_CHARS}; use a random "
                "one, e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')"
            )
    for network in settings.trusted_proxies:
        if ipaddress.ip_network(network, strict=False).prefixlen == 0:
            return f"AGENT_GATEWAY_TRUSTED_PROXIES names every address ({network})"
    return None


def settings_from(argv: list[str] | None = None) -> GatewaySettings:
    """The environment's settings with the command line's options on top."""
    args = build_parser().parse_args(argv)
    return GatewaySettings(**{k: v for k, v in vars(args).items() if v is not None})


def main(argv: list[str] | None = None) -> int:
    for name in unknown_variables(dict(os.environ)):
        print(f"agent-gateway: warning: {name} is not a setting (ignored)", file=sys.stderr)
    try:
        settings = settings_from(argv)
        unsafe = unsafe_settings(settings)
    except (ValidationError, ValueError, OSError) as exc:
        print(f"agent-gateway: bad configuration: {_first(exc)}", file=sys.stderr)
        return 2
    if unsafe:
        print(f"agent-gateway: unsafe configuration: {unsafe}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    import uvicorn

    from gateway import wscontrol
    from gateway.app import create_app
    from gateway.httphead import BoundedHead

    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        access_log=False,
        timeout_graceful_shutdown=5,
        # the peer address is the one the socket says: X-Forwarded-For would let anyone
        # pose as a trusted proxy (AGENT_GATEWAY_TRUSTED_PROXIES decides whom to believe)
        proxy_headers=False,
        ws_max_size=WS_MAX_FRAME_BYTES,
        ws=wscontrol.protocol(),  # pings capped (uvicorn answers them below the app)
        http=BoundedHead,  # a request head's size capped (httptools buffers any)
    )
    return 0


def _first(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        return f"{where}: {err['msg']}"
    return str(exc)


if __name__ == "__main__":
    raise SystemExit(main())
