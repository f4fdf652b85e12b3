"""Settings: the process configuration, from ``AGENT_*`` environment variables (SPEC 1)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from bus_redis.schema import DEFAULT_MAX_PAYLOAD_BYTES
from worker.config import LoopConfig, default_worker_id


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="AGENT_", extra="ignore")

    redis_url: str = "redis://localhost:6379/0"
    key_prefix: str = Field(default="agent", min_length=1)
    provider: Literal["openai", "echo"] = "echo"
    model: str = ""
    worker_id: str = Field(default_factory=default_worker_id)
    concurrency: int = Field(default=16, ge=1, le=10_000)
    lock_ttl_ms: int = Field(default=10_000, ge=300)
    owner_ttl_ms: int = Field(default=15_000, ge=300)
    unified_session: bool = False
    max_deliveries: int = Field(default=5, ge=1)
    max_payload_bytes: int = Field(default=DEFAULT_MAX_PAYLOAD_BYTES, ge=256)
    shutdown_grace_s: float = Field(default=10.0, ge=0)
    followup_mode: Literal["inject", "queue"] = "inject"
    max_iterations: int = Field(default=20, ge=1)
    stream_deltas: bool = False
    jobs: Literal["arq", "local"] = "arq"
    log_level: str = "INFO"

    @field_validator("redis_url")
    @classmethod
    def _url(cls, value: str) -> str:
        if not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must start with redis://, rediss:// or unix://")
        return value

    def loop_config(self) -> LoopConfig:
        return LoopConfig(
            worker_id=self.worker_id,
            concurrency=self.concurrency,
            max_iterations=self.max_iterations,
            max_deliveries=self.max_deliveries,
            max_payload_bytes=self.max_payload_bytes,
            shutdown_grace_s=self.shutdown_grace_s,
            followup_mode=self.followup_mode,
            stream_deltas=self.stream_deltas,
        )
