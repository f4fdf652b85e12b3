"""Settings: the process configuration, from ``AGENT_*`` environment variables."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from bus_redis.config import check_log_level, check_redis_url
from bus_redis.keys import valid_channel
from worker.config import LoopConfig


class Settings(BaseSettings, LoopConfig):
    """Everything of :class:`LoopConfig` plus what only a process needs."""

    model_config = SettingsConfigDict(env_prefix="AGENT_", extra="ignore", frozen=True)

    redis_url: str = "redis://localhost:6379/0"
    key_prefix: str = Field(default="agent", min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    provider: Literal["openai", "echo"] = "echo"
    model: str = ""
    jobs: Literal["arq", "local"] = "arq"
    log_level: str = "INFO"
    log_format: Literal["text", "json"] = "text"
    channels: Annotated[list[str], NoDecode] = Field(default_factory=list)  # "web,telegram"
    metrics_port: int = Field(default=0, ge=0, le=65535)  # /metrics /livez /readyz; 0 = off
    metrics_host: str = "127.0.0.1"

    @field_validator("redis_url")
    @classmethod
    def _url(cls, value: str) -> str:
        return check_redis_url(value)

    @field_validator("log_level")
    @classmethod
    def _level(cls, value: str) -> str:
        return check_log_level(value)

    @field_validator("channels", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        if isinstance(value, str):
            return [c.strip() for c in value.split(",") if c.strip()]
        return value

    @field_validator("channels")
    @classmethod
    def _channels(cls, value: list[str]) -> list[str]:
        bad = [c for c in value if not valid_channel(c)]
        if bad:
            raise ValueError(f"invalid channel name {bad[0]!r}")
        return value

    def loop_config(self) -> LoopConfig:
        return LoopConfig(**{name: getattr(self, name) for name in LoopConfig.model_fields})
