"""spawn: hand a task to a subagent that runs in the background on any worker; its result
comes back into this conversation as a system message (``worker.jobs.subagents``).
Durable conversations only; a subagent has no spawn of its own."""

from __future__ import annotations

from worker.agent.tools.base import ToolContext, schema


class SpawnTool:
    name = "spawn"
    description = (
        "Start a subagent on a self-contained task in the background. Its result arrives "
        "later in this conversation as a system message; do not wait for it."
    )
    parameters = schema(
        {
            "task": {"type": "string", "description": "what to do, with everything it needs"},
            "label": {"type": "string", "description": "a short name for it"},
        },
        ["task"],
    )
    idempotent = False  # a re-run after a crash does not start it again
    durable_only = True

    async def execute(self, ctx: ToolContext, task: str, label: str = "") -> str:
        if ctx.services is None:
            return "Error: subagents are not available here"
        return await ctx.services.spawn(ctx, str(task), str(label or ""))
