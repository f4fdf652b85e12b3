"""The background services the durable-only tools use, behind the agent's ``Services``
protocol (``worker.agent.tools.base``): the tools never import the jobs."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from worker.agent.tools.base import Origin, ToolContext
from worker.jobs.schedules import Schedules
from worker.jobs.subagents import Subagents


class BackgroundServices:
    def __init__(self, subagents: Subagents, schedules: Schedules) -> None:
        self.subagents = subagents
        self.schedules = schedules

    async def spawn(self, ctx: ToolContext, task: str, label: str) -> str:
        return await self.subagents.spawn(ctx, task, label)

    async def schedule(self, ctx: ToolContext, action: str, args: dict[str, Any]) -> str:
        return await self.schedules.handle(ctx, action, args)

    def undo_of(
        self, name: str, args: dict[str, Any], origin: Origin, call_id: str
    ) -> Callable[[], Awaitable[Any]] | None:
        if name == "cron" and args.get("action") == "add":
            return self.schedules.undo_add(origin, call_id)
        if name == "spawn":
            return self.subagents.undo_spawn(origin, call_id)
        return None
