"""Reading server-sent events in tests (httpx streams), and small HTTP helpers."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx


async def sse(
    client: httpx.AsyncClient, url: str, *, headers: dict[str, str] | None = None
) -> AsyncIterator[dict[str, Any]]:
    """Each event of an SSE response as ``{"event", "id", "data"}`` (comments skipped);
    ends when the server closes the stream."""
    async with client.stream("GET", url, headers=headers) as response:
        response.raise_for_status()
        event: dict[str, Any] = {}
        async for line in response.aiter_lines():
            if not line:
                if "data" in event:
                    event["data"] = json.loads(event["data"])
                    yield event
                event = {}
            elif line.startswith(":"):
                continue
            else:
                name, _, value = line.partition(":")
                value = value[1:] if value.startswith(" ") else value
                event[name] = event[name] + "\n" + value if name in event else value
