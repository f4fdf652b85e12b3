"""Agent tools. ``default_registry()`` holds the tools every session starts with;
a transient session's ``disabled_tools`` removes any of them (offered, named, executed), and
the durable-only ones (``spawn``, ``cron``) are never a transient session's."""

from worker.agent.tools.base import Tool, ToolContext, ToolRegistry
from worker.agent.tools.cron import CronTool
from worker.agent.tools.goals import CreateGoalTool, UpdateGoalTool
from worker.agent.tools.message import MessageTool
from worker.agent.tools.sessions import ReadSessionTool, SearchSessionsTool
from worker.agent.tools.spawn import SpawnTool


def default_registry() -> ToolRegistry:
    return ToolRegistry(
        [
            ReadSessionTool(),
            SearchSessionsTool(),
            CreateGoalTool(),
            UpdateGoalTool(),
            SpawnTool(),
            CronTool(),
            MessageTool(),
        ]
    )


__all__ = ["Tool", "ToolContext", "ToolRegistry", "default_registry"]
