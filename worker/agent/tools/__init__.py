"""Agent tools. ``default_registry()`` holds the tools every session starts with;
a transient session's ``disabled_tools`` removes any of them (offered, named, executed)."""

from worker.agent.tools.base import Tool, ToolContext, ToolRegistry
from worker.agent.tools.goals import CreateGoalTool, UpdateGoalTool
from worker.agent.tools.message import MessageTool
from worker.agent.tools.sessions import ReadSessionTool, SearchSessionsTool


def default_registry() -> ToolRegistry:
    return ToolRegistry(
        [ReadSessionTool(), SearchSessionsTool(), CreateGoalTool(), UpdateGoalTool(), MessageTool()]
    )


__all__ = ["Tool", "ToolContext", "ToolRegistry", "default_registry"]
