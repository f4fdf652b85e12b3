"""The typed results of the worker-side scripts (see ``lua/``) and the commit request."""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Notification:
    """One ready-queue (or inbox) entry: session ``session_key`` has work."""

    stream: str
    entry_id: str
    session_key: str
    direct: bool = False  # S is channel:chat_id (no override): unified mode maps it
    effective: bool = False  # S already names an effective key (recovery re-notify)


@dataclass(frozen=True, slots=True)
class Entry:
    member: str
    entry_id: str
    payload: str
    attempts: int
    flag: str


@dataclass(frozen=True, slots=True)
class More:
    members: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Released:
    pass


@dataclass(frozen=True, slots=True)
class Lost:
    pass


Step = Entry | More | Released | Lost


@dataclass(frozen=True, slots=True)
class Acquired:
    token: str
    version: int
    memory_version: int
    step: Step | None


@dataclass(frozen=True, slots=True)
class Busy:
    holder: str


@dataclass(frozen=True, slots=True)
class Forward:
    owner: str


AcquireResult = Acquired | Busy | Forward


@dataclass(slots=True)
class CommitSpec:
    """What one fenced commit writes (see ``lua/commit.lua``)."""

    member: str  # inbound stream (session key) of the entries
    entry_ids: list[str] = field(default_factory=list)
    reply: str = ""  # OutboundMessage JSON
    reply_channel: str = ""
    meta: str = ""  # session meta JSON; '' = nothing persisted
    rows: list[str] = field(default_factory=list)
    owner_op: str = ""  # '', 'set', 'del'
    owner_member: str = ""
    dead: str = ""  # dead-letter JSON


def parse_step(parts: list[str]) -> Step | None:
    if not parts:
        return None
    kind = parts[0]
    if kind == "entry":
        return Entry(parts[1], parts[2], parts[3], int(parts[4]), parts[5])
    if kind == "more":
        return More(tuple(parts[1:]))
    if kind == "released":
        return Released()
    return Lost()


def owner_member(session_key: str, channel: str, chat_id: str) -> str:
    """Owners-registry member: content-free route of a transient session."""
    return json.dumps([session_key, channel, chat_id], separators=(",", ":"))
