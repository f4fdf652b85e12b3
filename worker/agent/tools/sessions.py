"""read_session and search_sessions: read persisted conversations of the session's own
scope (read-only). A session of another scope is answered exactly like a missing one."""

from __future__ import annotations

from typing import Any

from worker.agent.tools.base import ToolContext, as_text, schema

_PUBLIC = ("role", "content", "timestamp")


def _public(rows: list[dict[str, Any]], limit: int) -> list[dict[str, Any]]:
    visible = [r for r in rows if r.get("role") in ("user", "assistant") and r.get("content")]
    return [{k: r.get(k) for k in _PUBLIC} for r in visible[-limit:]]


class ReadSessionTool:
    name = "read_session"
    description = "Read the recent messages of a session (default: the current one)."
    parameters = schema(
        {
            "session_key": {"type": "string"},
            "limit": {"type": "integer", "minimum": 1, "maximum": 200},
        }
    )
    idempotent = True  # reads only

    async def execute(self, ctx: ToolContext, session_key: str = "", limit: int = 20) -> str:
        if not session_key or session_key == ctx.session.key:
            return as_text(_public(ctx.session.messages, limit))
        payload = await ctx.sessions.read_session(session_key)
        if payload is None or not ctx.scope or payload.get("scope") != ctx.scope:
            return f"No stored session {session_key!r}"
        return as_text(_public(payload["messages"], limit))


class SearchSessionsTool:
    name = "search_sessions"
    description = "Search stored sessions for a text; returns matching session keys and snippets."
    parameters = schema(
        {"query": {"type": "string"}, "max_sessions": {"type": "integer"}}, ["query"]
    )
    idempotent = True  # reads only

    async def execute(self, ctx: ToolContext, query: str, max_sessions: int = 20) -> str:
        needle = query.casefold()
        hits: list[dict[str, str]] = []
        if not ctx.scope:
            return f"No session mentions {query!r}"
        scoped = await ctx.sessions.list_sessions(scope=ctx.scope)
        for info in scoped[: max(1, min(max_sessions, 100))]:
            payload = await ctx.sessions.read_session(info["key"])
            if payload is None or payload.get("scope") != ctx.scope:
                continue
            for row in (payload or {}).get("messages", [])[-200:]:
                content = row.get("content")
                if isinstance(content, str) and needle in content.casefold():
                    hits.append({"session_key": info["key"], "snippet": content[:200]})
                    break
        return as_text(hits or f"No session mentions {query!r}")
