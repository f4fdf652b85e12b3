"""GatewaySettings: the gateway's configuration, from ``AGENT_*`` / ``AGENT_GATEWAY_*``."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from bus_redis.config import check_log_level, check_redis_url
from bus_redis.keys import valid_channel
from bus_redis.schema import DEFAULT_MAX_PAYLOAD_BYTES, FollowUp

DURABLE_ONLY_TOOLS = ("create_goal", "update_goal", "spawn", "cron")  # nanobot's temporary chats


class GatewaySettings(BaseSettings):
    """One gateway replica. Every replica of a deployment uses the same values."""

    # populate_by_name: the aliased fields (redis_url, key_prefix, max_payload_bytes) also
    # take their own names
    # as keyword arguments (the CLI's --redis-url / --prefix, the demo)
    model_config = SettingsConfigDict(
        env_prefix="AGENT_GATEWAY_", extra="ignore", frozen=True, populate_by_name=True
    )

    redis_url: str = Field(
        default="redis://localhost:6379/0",
        validation_alias=AliasChoices("AGENT_GATEWAY_REDIS_URL", "AGENT_REDIS_URL"),
    )
    key_prefix: str = Field(
        default="agent",
        min_length=1,
        pattern=r"^[A-Za-z0-9_.-]+$",
        validation_alias=AliasChoices("AGENT_GATEWAY_KEY_PREFIX", "AGENT_KEY_PREFIX"),
    )
    channel: str = "web"
    # double texting for messages that name none: interrupt / reject are done here, inject /
    # queue by the workers (unset: the workers' AGENT_FOLLOWUP_MODE)
    followup: FollowUp | None = None
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    # auth: bearer tokens ("token=user,token2=user2") and/or a file of "token user" lines
    tokens: Annotated[dict[str, str], NoDecode] = Field(default_factory=dict)
    tokens_file: Path | None = None
    # a header set by a trusted reverse proxy, accepted only from these addresses
    user_header: str = "X-Forwarded-User"
    trusted_proxies: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # origins besides the gateway's own whose pages may post and open WebSockets
    # (gateway.origin: another site's page acting with the user's cookies is refused)
    allowed_origins: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # who may read /metrics (the operator's scraper), addresses or networks
    metrics_networks: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["127.0.0.1/32", "::1/128"]
    )
    ticket_ttl_s: int = Field(default=60, ge=5, le=3600)
    max_sessions_per_user: int = Field(default=500, ge=1)
    max_temporary_per_user: int = Field(default=5, ge=1)  # more: the oldest is discarded
    # a chat created this long ago whose session is no longer stored (the workers delete
    # sessions idle for AGENT_SESSION_TTL_S) leaves the user's list; 0 keeps them
    session_ttl_s: float = Field(
        default=90 * 86_400, ge=0, le=100 * 365 * 86_400, allow_inf_nan=False
    )
    # what one user may leave waiting for the workers (gateway.backlog): more is 429
    max_waiting_per_chat: int = Field(default=10, ge=1)  # entries in one chat's stream
    max_waiting_chats_per_user: int = Field(default=8, ge=1)  # chats with entries waiting
    max_streams: int = Field(default=10_000, ge=1)  # followed event streams per process
    max_streams_per_user: int = Field(default=64, ge=1)  # open subscriptions per user/process
    max_sockets_per_user: int = Field(default=16, ge=1)  # open WebSockets per user/process
    # how often one user may ask this replica (gateway.ratelimit): past it a request waits,
    # then 429; 0: no limit
    user_rate: float = Field(default=20.0, ge=0, le=1e6, allow_inf_nan=False)  # a second
    user_burst: int = Field(default=100, ge=1)  # ... and how many may be saved up
    max_body_bytes: int = Field(default=1 << 20, ge=1024)  # a request body, whatever route
    # a message as published (text, metadata, envelope): the workers' AGENT_MAX_PAYLOAD_BYTES
    max_payload_bytes: int = Field(
        default=DEFAULT_MAX_PAYLOAD_BYTES,
        ge=256,
        validation_alias=AliasChoices("AGENT_GATEWAY_MAX_PAYLOAD_BYTES", "AGENT_MAX_PAYLOAD_BYTES"),
    )
    body_timeout_s: float = Field(
        default=30.0, gt=0, le=86_400, allow_inf_nan=False
    )  # to receive a request body, whole
    # to answer a request that does not wait by design (else 503: Redis did not answer)
    request_timeout_s: float = Field(default=10.0, gt=0, le=86_400, allow_inf_nan=False)
    redis_connections: int = Field(default=16, ge=2, le=1024)
    readers: int = Field(default=8, ge=1, le=64)  # blocking connections sharing the streams
    keepalive_s: float = Field(default=15.0, gt=0, le=86_400, allow_inf_nan=False)
    sse_retry_ms: int = Field(default=2000, ge=100, le=86_400_000)
    wait_max_s: float = Field(default=120.0, gt=0, le=86_400, allow_inf_nan=False)
    history_limit: int = Field(default=200, ge=1, le=10_000)
    temporary_disabled_tools: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: list(DURABLE_ONLY_TOOLS)
    )
    log_level: str = "INFO"

    @field_validator("redis_url")
    @classmethod
    def _url(cls, value: str) -> str:
        return check_redis_url(value)

    @field_validator("log_level")
    @classmethod
    def _level(cls, value: str) -> str:
        return check_log_level(value)

    @field_validator("channel")
    @classmethod
    def _channel(cls, value: str) -> str:
        if not valid_channel(value):
            raise ValueError("must be 1-64 letters, digits, '_' or '-' (not 'unified')")
        return value

    @field_validator("user_rate")
    @classmethod
    def _rate(cls, value: float) -> float:
        if 0 < value < 0.001:
            raise ValueError("0 (no limit) or at least 0.001 a second")
        return value

    @field_validator("tokens", mode="before")
    @classmethod
    def _tokens(cls, value: object) -> object:
        if isinstance(value, str):
            pairs = [p.strip() for p in value.split(",") if p.strip()]
            out: dict[str, str] = {}
            for pair in pairs:
                token, sep, user = pair.partition("=")
                if not sep or not token or not user:
                    raise ValueError("must be token=user pairs separated by commas")
                out[token] = user
            return out
        return value

    @field_validator(
        "trusted_proxies",
        "temporary_disabled_tools",
        "metrics_networks",
        "allowed_origins",
        mode="before",
    )
    @classmethod
    def _split(cls, value: object) -> object:
        if isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
        return value

    @field_validator("allowed_origins")
    @classmethod
    def _origins(cls, value: list[str]) -> list[str]:
        for item in value:
            scheme, sep, host = item.partition("://")
            if scheme not in ("http", "https") or not sep or not host or "/" in host.rstrip("/"):
                raise ValueError(f"{item!r} is not an origin (scheme://host[:port])")
        return value

    @field_validator("trusted_proxies", "metrics_networks")
    @classmethod
    def _addresses(cls, value: list[str]) -> list[str]:
        for item in value:
            try:
                ipaddress.ip_network(item, strict=False)
            except ValueError:
                raise ValueError(f"{item!r} is not an IP address or network") from None
        return value

    def all_tokens(self) -> dict[str, str]:
        """Tokens from the environment and from ``tokens_file`` (``token user`` lines,
        ``#`` comments)."""
        tokens = dict(self.tokens)
        if self.tokens_file is not None:
            for n, line in enumerate(self.tokens_file.read_text().splitlines(), 1):
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                token, _, user = line.partition(" ")
                if not token or not user.strip():
                    raise ValueError(f"{self.tokens_file}:{n}: expected 'TOKEN USER'")
                tokens[token] = user.strip()
        return tokens
