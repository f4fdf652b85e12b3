"""Loads the Lua scripts in ``lua/`` once per client (EVALSHA with NOSCRIPT fallback)."""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import Any

from redis.asyncio import Redis
from redis.commands.core import AsyncScript

_WITH_PRELUDE = frozenset({"acquire", "next", "commit"})
SCRIPT_NAMES = (
    "acquire",
    "next",
    "commit",
    "release",
    "renew",
    "emit",
    "sweep",
    "owner",
    "owner_lost",
    "control",
)


@cache
def script_source(name: str) -> str:
    """The source of one script, with the shared prelude where it needs it."""
    folder = resources.files("bus_redis") / "lua"
    body = (folder / f"{name}.lua").read_text(encoding="utf-8")
    if name in _WITH_PRELUDE:
        return (folder / "_common.lua").read_text(encoding="utf-8") + "\n" + body
    return body


class Scripts:
    """The registered scripts of one Redis client, by name."""

    def __init__(self, redis: Redis) -> None:
        self._scripts: dict[str, AsyncScript] = {
            name: redis.register_script(script_source(name)) for name in SCRIPT_NAMES
        }

    async def call(self, name: str, keys: list[str], args: list[Any], *, client: Any = None) -> Any:
        """Run a script; with a pipeline as ``client`` it is queued instead."""
        return await self._scripts[name](keys=keys, args=args, client=client)
