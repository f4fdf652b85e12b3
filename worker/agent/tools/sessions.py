"""read_session and search_sessions: read persisted conversations of the session's own
scope (read-only). A session of another scope is answered exactly like a missing one."""

from __future__ import annotations

from typing import Any

from worker.agent.tools.arguments import RESULT_MAX_CHARS
from worker.agent.tools.base import ToolContext, as_text, schema

_PUBLIC = ("role", "content", "timestamp")
# rows read of a stored session: a read costs what it can return, not the session's length
# (tool and empty rows are read too, and left out)
READ_ROWS = 1000
SEARCHED_ROWS = 200  # the newest rows of each session a search looks at
SEARCHED_SESSIONS = 100


def _public(rows: list[dict[str, Any]], limit: int) -> str:
    """The newest ``limit`` user and assistant rows, as JSON within ``RESULT_MAX_CHARS``:
    older rows are left out, and a row alone longer than that is cut, so the answer stays
    readable JSON instead of being cut mid-way by the registry."""
    visible = [r for r in rows if r.get("role") in ("user", "assistant") and r.get("content")]
    room = RESULT_MAX_CHARS - 2  # the brackets
    kept: list[str] = []
    for r in reversed(visible[-limit:]):
        row = {k: r.get(k) for k in _PUBLIC}
        doc = as_text(row)
        if len(doc) + 2 > room and not kept:  # the newest row alone is too long: cut it
            content = str(row.get("content", ""))
            row["content"] = content[: max(0, len(content) - (len(doc) + 2 - room) - 64)]
            row["content"] += " ... (cut)"
            doc = as_text(row)
        if len(doc) + 2 > room:
            break
        kept.append(doc)
        room -= len(doc) + 2  # and a separator
    return "[" + ", ".join(reversed(kept)) + "]"


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
            return _public(ctx.session.messages, limit)
        payload = await ctx.sessions.read_session(session_key, last=READ_ROWS)
        if payload is None or not ctx.scope or payload.get("scope") != ctx.scope:
            return f"No stored session {session_key!r}"
        return _public(payload["messages"], limit)


class SearchSessionsTool:
    name = "search_sessions"
    description = "Search stored sessions for a text; returns matching session keys and snippets."
    parameters = schema(
        {
            "query": {"type": "string", "minLength": 1, "maxLength": 1000},
            "max_sessions": {"type": "integer", "minimum": 1, "maximum": SEARCHED_SESSIONS},
        },
        ["query"],
    )
    idempotent = True  # reads only

    async def execute(self, ctx: ToolContext, query: str, max_sessions: int = 20) -> str:
        needle = query.casefold()
        hits: list[dict[str, str]] = []
        if not ctx.scope:
            return f"No session mentions {query!r}"
        limit = max(1, min(max_sessions, SEARCHED_SESSIONS))
        for info in await ctx.sessions.list_sessions(scope=ctx.scope, limit=limit):
            payload = await ctx.sessions.read_session(info["key"], last=SEARCHED_ROWS)
            if payload is None or payload.get("scope") != ctx.scope:
                continue
            for row in payload.get("messages", []):
                content = row.get("content")
                if isinstance(content, str) and needle in content.casefold():
                    hits.append({"session_key": info["key"], "snippet": content[:200]})
                    break
        return as_text(hits or f"No session mentions {query!r}")
