"""message: send a message to the user before the turn's final answer."""

from __future__ import annotations

from worker.agent.tools.base import ToolContext, schema


class MessageTool:
    name = "message"
    description = "Send a message to the user now, while the turn goes on."
    parameters = schema({"content": {"type": "string"}}, ["content"])
    idempotent = False  # the user has seen it: a re-run after a crash does not send it again

    async def execute(self, ctx: ToolContext, content: str) -> str:
        await ctx.emit(content)
        return "sent"
