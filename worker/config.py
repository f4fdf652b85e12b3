"""LoopConfig: the tuning of one AgentLoop (built from Settings at the entry point)."""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, field

from bus_redis.schema import DEFAULT_MAX_PAYLOAD_BYTES


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True, slots=True)
class LoopConfig:
    worker_id: str = field(default_factory=default_worker_id)
    concurrency: int = 16
    max_iterations: int = 20
    max_deliveries: int = 5
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    shutdown_grace_s: float = 10.0
    read_block_ms: int = 1000
    history_tokens: int = 16_000
    consolidate_above_tokens: int = 24_000
    followup_mode: str = "inject"  # "inject": follow-ups join the running turn; "queue": own turns
    followups_per_pull: int = 3
    stream_deltas: bool = False  # forward the provider's streamed text as `delta` events
