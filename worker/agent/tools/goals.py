"""create_goal and update_goal: goals kept in the session's metadata (durable tools)."""

from __future__ import annotations

import uuid
from typing import Any

from worker.agent.tools.base import ToolContext, as_text, schema

_STATUSES = ("open", "done", "abandoned")


def _goals(ctx: ToolContext) -> list[dict[str, Any]]:
    goals = ctx.session.metadata.setdefault("goals", [])
    if not isinstance(goals, list):
        goals = ctx.session.metadata["goals"] = []
    return goals


class CreateGoalTool:
    name = "create_goal"
    description = "Record a goal for this session; returns its id."
    parameters = schema({"title": {"type": "string"}}, ["title"])

    async def execute(self, ctx: ToolContext, title: str) -> str:
        goal = {"id": uuid.uuid4().hex[:8], "title": title, "status": "open"}
        _goals(ctx).append(goal)
        return as_text(goal)


class UpdateGoalTool:
    name = "update_goal"
    description = "Change a goal's status (open, done, abandoned) or title."
    parameters = schema(
        {
            "goal_id": {"type": "string"},
            "status": {"type": "string", "enum": list(_STATUSES)},
            "title": {"type": "string"},
        },
        ["goal_id"],
    )

    async def execute(
        self, ctx: ToolContext, goal_id: str, status: str = "", title: str = ""
    ) -> str:
        for goal in _goals(ctx):
            if goal.get("id") == goal_id:
                if status:
                    if status not in _STATUSES:
                        return f"Error: status must be one of {', '.join(_STATUSES)}"
                    goal["status"] = status
                if title:
                    goal["title"] = title
                return as_text(goal)
        return f"Error: no goal {goal_id!r}"
