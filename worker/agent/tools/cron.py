"""cron: add, list and remove scheduled turns of this conversation
(``worker.jobs.schedules``). Durable conversations only: a private session can never
schedule anything."""

from __future__ import annotations

from typing import Any

from worker.agent.tools.base import ToolContext, schema


class CronTool:
    name = "cron"
    description = (
        "Schedule a future turn of this conversation: action 'add' with 'message' and one "
        "of 'at' (ISO 8601 time), 'every_seconds' or 'cron_expr' (5 fields) with an "
        "optional IANA 'tz'; 'list'; 'remove' with 'id'. At its time the message arrives "
        "here as a system message."
    )
    parameters = schema(
        {
            "action": {"type": "string", "enum": ["add", "list", "remove"]},
            "message": {"type": "string"},
            "at": {"type": "string"},
            "every_seconds": {"type": "integer", "minimum": 1},
            "cron_expr": {"type": "string"},
            "tz": {"type": "string"},
            "id": {"type": "string"},
        },
        ["action"],
    )
    idempotent = False  # the schedule's id follows the call: adding again is a no-op anyway
    durable_only = True

    async def execute(self, ctx: ToolContext, action: str, **args: Any) -> str:
        if ctx.services is None:
            return "Error: schedules are not available here"
        return await ctx.services.schedule(ctx, str(action), args)
