"""Settings: the process configuration, from ``AGENT_*`` environment variables."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from bus_redis.config import check_log_level, check_redis_url
from bus_redis.keys import valid_channel
from worker.config import LoopConfig
from worker.runtime.collector import DEFAULT_YOUNG_THRESHOLD
from worker.runtime.eventloop import DEFAULT_LINGER_US


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
    tools_allow: Annotated[list[str], NoDecode] = Field(default_factory=list)  # "a,b"
    tools_deny: Annotated[list[str], NoDecode] = Field(default_factory=list)
    metrics_port: int = Field(default=0, ge=0, le=65535)  # /metrics /livez /readyz; 0 = off
    system_prompt_file: Path | None = None  # the system prompt from a file (wins over text)
    temperature: float = Field(default=0.7, ge=0, le=2)
    max_tokens: int = Field(default=4096, ge=1)  # per model reply
    provider_timeout_s: float = Field(default=120.0, gt=0)  # a model request's longest silence
    provider_deadline_s: float = Field(default=600.0, gt=0)  # one model request, start to end
    provider_retries: int = Field(default=3, ge=0, le=10)
    metrics_host: str = "127.0.0.1"
    # after a wake-up with one ready socket, wait this long for more (0 = off)
    loop_linger_us: int = Field(default=DEFAULT_LINGER_US, ge=0, le=10_000)
    # objects a generation-0 garbage collection waits for (0 = Python's own, 700)
    gc_young_threshold: int = Field(default=DEFAULT_YOUNG_THRESHOLD, ge=0, le=1_000_000)

    @field_validator("redis_url")
    @classmethod
    def _url(cls, value: str) -> str:
        return check_redis_url(value)

    @field_validator("log_level")
    @classmethod
    def _level(cls, value: str) -> str:
        return check_log_level(value)

    @field_validator("tools_allow", "tools_deny", mode="before")
    @classmethod
    def _split_tools(cls, value: object) -> object:
        if isinstance(value, str):
            return [t.strip() for t in value.split(",") if t.strip()]
        return value

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

    @model_validator(mode="before")
    @classmethod
    def _prompt_file(cls, data: Any) -> Any:
        """AGENT_SYSTEM_PROMPT_FILE: the system prompt's text from a file (wins over
        AGENT_SYSTEM_PROMPT)."""
        path = data.get("system_prompt_file") if isinstance(data, dict) else None
        if not path:
            return data
        try:
            text = Path(path).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ValueError(f"cannot read AGENT_SYSTEM_PROMPT_FILE: {exc.strerror}") from None
        if not text:
            raise ValueError("AGENT_SYSTEM_PROMPT_FILE is empty")
        return {**data, "system_prompt": text}

    @model_validator(mode="after")
    def _known_tools(self) -> Settings:
        from worker.agent.tools import default_registry

        known = default_registry().names
        for name in [*self.tools_allow, *self.tools_deny]:
            if name not in known:
                raise ValueError(
                    f"unknown tool {name!r} in AGENT_TOOLS_ALLOW/AGENT_TOOLS_DENY "
                    f"(tools: {', '.join(known)})"
                )
        return self

    def loop_config(self) -> LoopConfig:
        return LoopConfig(**{name: getattr(self, name) for name in LoopConfig.model_fields})
