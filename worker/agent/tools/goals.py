"""create_goal and update_goal: goals kept in the session's metadata (durable tools), at
most ``MAX_GOALS`` of at most ``TITLE_MAX_CHARS`` each (every commit writes them)."""

from __future__ import annotations

import hashlib
import uuid
from typing import Any

from worker.agent.tools.base import ToolContext, as_text, schema

_STATUSES = ("open", "done", "abandoned")
# the session's metadata holds them, and every commit writes the metadata whole: bounded
MAX_GOALS = 32  # a new goal past it replaces the oldest closed one (none closed: refused)
TITLE_MAX_CHARS = 300
_TITLE = {"type": "string", "minLength": 1, "maxLength": TITLE_MAX_CHARS}


def _goals(ctx: ToolContext) -> list[dict[str, Any]]:
    goals = ctx.session.metadata.setdefault("goals", [])
    if not isinstance(goals, list):
        goals = ctx.session.metadata["goals"] = []
    return goals


class CreateGoalTool:
    name = "create_goal"
    description = "Record a goal for this session; returns its id."
    parameters = schema({"title": _TITLE}, ["title"])
    idempotent = True  # its effect lands with the turn's commit; the id follows the call

    async def execute(self, ctx: ToolContext, title: str) -> str:
        goals = _goals(ctx)
        goal_id = _goal_id(ctx.call_id)
        for goal in goals:
            if goal.get("id") == goal_id:  # the same call, run again
                return as_text(goal)
        if len(goals) >= MAX_GOALS:
            closed = [g for g in goals if g.get("status") != "open"]
            if not closed:
                return f"Error: this session has {len(goals)} open goals; close one first"
            goals.remove(closed[0])
        goal = {"id": goal_id, "title": title, "status": "open"}
        goals.append(goal)
        return as_text(goal)


def _goal_id(call_id: str) -> str:
    """Derived from the tool call, so a call run again (a turn re-run after a crash)
    names the same goal; random when there is no call id."""
    if not call_id:
        return uuid.uuid4().hex[:8]
    return hashlib.sha256(call_id.encode("utf-8", "surrogatepass")).hexdigest()[:8]


class UpdateGoalTool:
    name = "update_goal"
    description = "Change a goal's status (open, done, abandoned) or title."
    parameters = schema(
        {
            "goal_id": {"type": "string"},
            "status": {"type": "string", "enum": list(_STATUSES)},
            "title": _TITLE,
        },
        ["goal_id"],
    )
    idempotent = True

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
