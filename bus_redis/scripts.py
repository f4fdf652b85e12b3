"""Loads the Lua scripts in ``lua/`` (EVALSHA with NOSCRIPT fallback).

Replies are read undecoded (bytes) whatever the client's ``decode_responses``: a payload
that is not valid UTF-8 must reach the worker's policy (and be answered
``invalid_message``) instead of failing the script call that selects it.
"""

from __future__ import annotations

import hashlib
from functools import cache
from importlib import resources
from typing import Any

from redis.asyncio import Redis
from redis.client import NEVER_DECODE
from redis.exceptions import NoScriptError

from bus_redis.mux import Multiplexed

_WITH_PRELUDE = frozenset({"acquire", "next", "commit", "markers", "release", "interrupts"})
# _events.lua: ending a session's events (and where a private session ended)
_WITH_EVENTS = frozenset({"owner", "owner_lost", "delete"})
_WITH_CRONS = frozenset({"cron_remove", "cron_fire", "delete"})  # _crons.lua: a scope's count
# _openings.lua: whether a private session is open on a chat's key or its opening waits
_WITH_OPENINGS = frozenset({"cron_fire", "spawn_done"})
SCRIPT_NAMES = (
    "acquire",
    "next",
    "commit",
    "release",
    "hold",
    "renew",
    "emit",
    "sweep",
    "owner",
    "owner_lost",
    "consolidate",
    "delete",
    "markers",
    "interrupts",
    "tidy",
    "compact",
    "hint",
    "beat",
    "claim",
    "heartbeat",
    "dead",
    "takeover",
    "journal",
    "cron_add",
    "cron_remove",
    "cron_fire",
    "spawn_add",
    "spawn_done",
)


@cache
def script_source(name: str) -> str:
    """The source of one script, with the shared prelude where it needs it."""
    folder = resources.files("bus_redis") / "lua"
    body = (folder / f"{name}.lua").read_text(encoding="utf-8")
    if name in _WITH_PRELUDE:
        return (folder / "_common.lua").read_text(encoding="utf-8") + "\n" + body
    if name in _WITH_OPENINGS:
        body = (folder / "_openings.lua").read_text(encoding="utf-8") + "\n" + body
    if name in _WITH_CRONS:
        body = (folder / "_crons.lua").read_text(encoding="utf-8") + "\n" + body
    if name in _WITH_EVENTS:
        return (folder / "_events.lua").read_text(encoding="utf-8") + "\n" + body
    return body


@cache
def script_sha(name: str) -> str:
    return hashlib.sha1(script_source(name).encode("utf-8")).hexdigest()


class Scripts:
    """The scripts of one Redis client, by name; sent over ``fast`` (``bus_redis.mux``)
    when given."""

    def __init__(self, redis: Redis, fast: Multiplexed | None = None) -> None:
        self.redis = redis
        self.fast = fast

    async def load_all(self) -> None:
        """SCRIPT LOAD every script once (at start), so that concurrent first calls do not
        each pay a NOSCRIPT round trip."""
        for name in SCRIPT_NAMES:
            await self.redis.script_load(script_source(name))

    async def call(self, name: str, keys: list[str], args: list[Any], *, now: bool = False) -> Any:
        """Run a script; its reply is returned undecoded (bytes). ``now``: sent at once
        (``Multiplexed.send``)."""
        if self.fast is not None:
            try:
                return await self.fast.send(
                    ("EVALSHA", script_sha(name), len(keys), *keys, *args), now=now
                )
            except NoScriptError:
                return await self.fast.send(
                    ("EVAL", script_source(name), len(keys), *keys, *args), now=now
                )
        argv = [len(keys), *keys, *args]
        try:
            return await self.redis.execute_command(
                "EVALSHA", script_sha(name), *argv, **{NEVER_DECODE: True}
            )
        except NoScriptError:
            return await self.redis.execute_command(
                "EVAL", script_source(name), *argv, **{NEVER_DECODE: True}
            )
