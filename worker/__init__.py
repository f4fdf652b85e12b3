"""worker: the consumer loop, leases, the agent turn, providers, tools and the CLI."""

from worker.config import LoopConfig
from worker.runtime.loop import AgentLoop

__all__ = ["AgentLoop", "LoopConfig"]
