"""Agent tools. ``default_registry()`` holds the tools every session starts with;
a transient session's ``disabled_tools`` removes any of them (offered, named, executed)."""

from worker.tools.base import Tool, ToolContext, ToolRegistry
from worker.tools.goals import CreateGoalTool, UpdateGoalTool
from worker.tools.message import MessageTool
from worker.tools.sessions import ReadSessionTool, SearchSessionsTool


def default_registry() -> ToolRegistry:
    return ToolRegistry(
        [ReadSessionTool(), SearchSessionsTool(), CreateGoalTool(), UpdateGoalTool(), MessageTool()]
    )


__all__ = ["Tool", "ToolContext", "ToolRegistry", "default_registry"]
