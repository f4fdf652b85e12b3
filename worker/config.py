"""LoopConfig: the tuning of one AgentLoop, with every default in one place.

``worker.settings.Settings`` extends it with the process-level settings and reads all of
them from ``AGENT_*`` environment variables; embedding code builds a ``LoopConfig``.
"""

from __future__ import annotations

import os
import socket
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from bus_redis.schema import DEFAULT_MAX_PAYLOAD_BYTES
from session_store.redis_store import NON_TURN_HOLDERS


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


MIN_LIVENESS_MS = 200  # AGENT_LIVENESS_MS below it (but 0) is refused
# durations go into Redis commands as they are (PX, PEXPIRE, BLOCK): past these (100
# years) a value is refused as bad configuration, not by Redis mid-commit
MAX_S = 100 * 365 * 86_400
MAX_MS = MAX_S * 1000


class LoopConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    worker_id: str = Field(default_factory=default_worker_id, min_length=1)
    concurrency: int = Field(default=16, ge=1, le=10_000)
    lock_ttl_ms: int = Field(default=10_000, ge=300, le=MAX_MS)
    owner_ttl_ms: int = Field(default=15_000, ge=300, le=MAX_MS)
    # a worker whose liveness beat is older than this is dead: its leases are taken over
    # (worker/runtime/liveness.py); 0 = only when they run out; else at least
    # MIN_LIVENESS_MS (beats every liveness / 8: a pause of a few ms must not look dead)
    liveness_ms: int = Field(default=800, ge=0, le=MAX_MS)
    unified_session: bool = False  # fold every durable session into unified:default
    single_owner: bool = False  # one memory, every session readable (implied by unified)
    channels: list[str] = Field(default_factory=list)  # served besides registered ones
    max_iterations: int = Field(default=20, ge=1)
    max_deliveries: int = Field(default=5, ge=1)
    max_payload_bytes: int = Field(default=DEFAULT_MAX_PAYLOAD_BYTES, ge=256)
    shutdown_grace_s: float = Field(default=10.0, ge=0, le=MAX_S, allow_inf_nan=False)
    read_block_ms: int = Field(default=1000, ge=1, le=MAX_MS)
    sweep_interval_ms: int = Field(default=5000, ge=50, le=MAX_MS)
    reply_maxlen: int = Field(default=1000, ge=10, le=1_000_000_000)
    reply_ttl_ms: int = Field(default=3_600_000, ge=1000, le=MAX_MS)
    transient_reply_ttl_ms: int = Field(default=60_000, ge=1000, le=MAX_MS)
    history_tokens: int = Field(default=16_000, ge=1)
    consolidate_above_tokens: int = Field(default=24_000, ge=1)
    session_cache_sessions: int = Field(default=16_384, ge=1)  # durable sessions cached
    session_cache_rows: int = Field(default=250_000, ge=1)  # their rows, at most (~150 MB)
    session_cache_chars: int = Field(default=256 << 20, ge=1)  # their rows' characters, at most
    memory_max_chars: int = Field(default=4_000, ge=200)  # a scope's long-term memory, at most
    max_private_sessions: int = Field(default=1000, ge=1)  # open at once, per worker and channel
    private_idle_s: float = Field(
        default=3600.0, ge=1, le=MAX_S, allow_inf_nan=False
    )  # a private session idle this long closes
    private_history_rows: int = Field(default=400, ge=10)  # rows a private session keeps
    private_history_chars: int = Field(default=1 << 20, ge=65_536)  # ... and their characters
    followup_mode: Literal["inject", "queue"] = "inject"
    followups_per_pull: int = Field(default=3, ge=1)
    stream_deltas: bool = False  # forward the provider's streamed text as `delta` events
    session_ttl_s: float = Field(
        default=90 * 86_400, ge=0, le=100 * 365 * 86_400
    )  # idle durable sessions; 0 = keep
    system_prompt: str = ""  # the assistant's identity ('' = the built-in one)
    tools_allow: list[str] = Field(default_factory=list)  # only these tools ([] = all)
    tools_deny: list[str] = Field(default_factory=list)  # never these tools
    cron_max_per_session: int = Field(default=10, ge=1, le=1000)  # schedules a session keeps
    cron_max_per_channel: int = Field(default=10_000, ge=1)  # and all sessions of a channel
    cron_max_per_scope: int = Field(default=100, ge=1)  # ... of one scope (a user's chats)
    cron_min_every_s: int = Field(default=60, ge=1)  # the shortest repeat a schedule may have
    subagents_per_session: int = Field(default=2, ge=1, le=100)  # running at once
    subagent_sessions_per_channel: int = Field(default=8, ge=1)  # sessions running some
    # ... of one scope (a user): one user cannot take every session slot of the channel
    subagent_sessions_per_scope: int = Field(default=2, ge=1)
    subagent_max_iterations: int = Field(default=8, ge=1)  # a subagent's tool rounds
    # consolidation jobs of one channel a worker runs at once (a further one is left to
    # the session's next commit): a channel's long sessions never take every job slot
    consolidations_per_channel: int = Field(default=4, ge=1)
    # a subagent's time, at most (below the job queue's own limit, JOB_TIMEOUT_S = 900 s,
    # with room for its start's and its result's retries)
    subagent_timeout_s: float = Field(default=300.0, gt=0, le=550)

    @field_validator("liveness_ms")
    @classmethod
    def _liveness(cls, value: int) -> int:
        if 0 < value < MIN_LIVENESS_MS:
            raise ValueError(f"0 (off) or at least {MIN_LIVENESS_MS} ms")
        return value

    @field_validator("worker_id")
    @classmethod
    def _not_a_non_turn_holder(cls, value: str) -> str:
        if value in NON_TURN_HOLDERS:
            raise ValueError(
                f"worker id {value!r} is reserved: it names the holder of a lease taken "
                "without a turn (sessions delete, the idle prune)"
            )
        return value

    @model_validator(mode="before")
    @classmethod
    def _owner_ttl_follows_the_lease(cls, data: Any) -> Any:
        """An owner record is renewed every lease TTL / 3, so it must outlive that: by
        default it is the larger of 15 s and 1.5 lease TTLs; a shorter one is refused."""
        if isinstance(data, dict) and data.get("owner_ttl_ms") in (None, ""):
            lock = int(data.get("lock_ttl_ms") or 10_000)
            data = {**data, "owner_ttl_ms": max(15_000, lock * 3 // 2)}
        return data

    @model_validator(mode="after")
    def _owner_outlives_renewal(self) -> LoopConfig:
        if self.owner_ttl_ms < self.lock_ttl_ms:
            raise ValueError(
                "AGENT_OWNER_TTL_MS must be at least AGENT_LOCK_TTL_MS (owner records are "
                "renewed every lock TTL / 3)"
            )
        return self

    @property
    def owner_mode(self) -> bool:
        """nanobot's single-owner behaviour: one memory, every session readable."""
        return self.single_owner or self.unified_session
