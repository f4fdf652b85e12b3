"""The typed results of the worker-side scripts (see ``lua/``) and the commit request."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from bus_redis.codec import payload_text, text, texts


@dataclass(frozen=True, slots=True)
class Notification:
    """One ready-queue (or inbox) entry: session ``session_key`` has work."""

    stream: str
    entry_id: str
    session_key: str
    effective: bool = False  # names an effective key K (a release re-notify), not a stream S


@dataclass(frozen=True, slots=True)
class Entry:
    member: str
    entry_id: str
    payload: str
    attempts: int
    covered_by: (
        str  # 'stop' / 'discard' / 'delete': a control marker queued after this entry; '' none
    )


@dataclass(frozen=True, slots=True)
class ControlReached:
    """A discard, new or delete marker at the head of stream ``member``: a discard was
    consumed; a new or delete marker (``marker``, its id) stays at the head until the
    holder's next ``next`` consumes it, after its effect (``attempts``: how often it was
    reached, as an entry's deliveries are counted)."""

    member: str
    op: str
    marker: str = ""
    attempts: int = 0


@dataclass(frozen=True, slots=True)
class More:
    members: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Again:
    """A bounded step (control markers consumed, a marker scan) left work: call again."""


@dataclass(frozen=True, slots=True)
class Released:
    pass


@dataclass(frozen=True, slots=True)
class Lost:
    pass


@dataclass(frozen=True, slots=True)
class Late:
    """A commit refused, nothing written: a message arrived after the turn's last read
    of its stream (``CommitSpec.late_after``) and may join the turn."""


Step = Entry | ControlReached | More | Again | Released | Lost


@dataclass(frozen=True, slots=True)
class Cached:
    """The worker's cached copy of a durable session, as acquire compares it: the hash's
    rows it has seen, its generation and version, and how many rows past them to read in
    the same call when it is behind."""

    rows: int
    generation: str
    version: int
    ahead: int


@dataclass(frozen=True, slots=True)
class Ahead:
    """What acquire read for a cached copy that is behind: the hash's meta and row count
    at ``version`` of ``generation``, and its rows from ``start`` on, up to ``count`` (a
    row that is missing is None)."""

    start: int
    version: int
    generation: str
    meta: str
    count: int
    rows: tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class Acquired:
    token: str
    version: int
    generation: str  # of the session hash: a deleted and re-created session has a new one
    memory_version: int
    step: Step | None
    ahead: Ahead | None = None  # the rows a cached copy lacked (acquire was given ``Cached``)


@dataclass(frozen=True, slots=True)
class Busy:
    holder: str


@dataclass(frozen=True, slots=True)
class Forward:
    owner: str


@dataclass(frozen=True, slots=True)
class Private:
    """The notified stream is an open private session: acquire it under its own key."""


@dataclass(frozen=True, slots=True)
class Gone:
    """The private session this worker holds has no owner record any more: it was lost
    (the record ran out while the worker stalled); forget it, and acquire again."""


@dataclass(frozen=True, slots=True)
class Fold:
    """The notified stream is no private session (any more) and streams are folded under
    another key (unified mode): acquire it under that key."""


AcquireResult = Acquired | Busy | Forward | Private | Fold | Gone


@dataclass(slots=True)
class CommitSpec:
    """What one fenced commit writes (see ``lua/commit.lua``)."""

    member: str  # inbound stream (session key) of the entries; its events stream gets the reply
    entry_ids: list[str] = field(default_factory=list)
    reply: str = ""  # OutboundMessage JSON
    meta: str = ""  # session meta JSON; '' = nothing persisted
    scope: str = ""  # the session's scope (its index gets the session)
    transient: bool = False  # shorter event retention
    rows: list[str] = field(default_factory=list)
    owner_op: str = ""  # '', 'set', 'del'
    owner_member: str = ""
    dead: str = ""  # dead-letter JSON
    outcome: str = ""  # 'message' or the error code of the reply (metrics, the turn's log line)
    dead_reason: str = ""  # why it was dead-lettered (metrics)
    message_id: str = ""  # the answered message's id (the turn's log line)
    tokens: tuple[int, int] = (0, 0)  # in, out, as the provider reported them (log line)
    journaled: bool = False  # the turn kept a tool journal: the commit drops it
    # an entry id: a payload entry after it in the member's stream refuses the commit
    # (``Late``): the turn reads its stream once more and may go on
    late_after: str = ""


def parse_step(raw: list[Any]) -> Step | None:
    """A script's step reply (raw values); an entry's payload keeps undecodable bytes as
    surrogates, so the worker can reject it instead of failing here."""
    if not raw:
        return None
    kind = text(raw[0])
    if kind == "entry":  # (the payload, maybe large, is decoded once)
        return Entry(text(raw[1]), text(raw[2]), payload_text(raw[3]), int(raw[4]), text(raw[5]))
    if kind == "control":
        marker, attempts = (text(raw[3]), int(raw[4])) if len(raw) > 4 else ("", 0)
        return ControlReached(text(raw[1]), text(raw[2]), marker, attempts)
    if kind == "more":
        return More(tuple(texts(raw[1:])))
    if kind == "again":
        return Again()
    if kind == "released":
        return Released()
    return Lost()


def owner_member(session_key: str, channel: str, chat_id: str) -> str:
    """Owners-registry member: content-free route of a transient session."""
    return json.dumps([session_key, channel, chat_id], separators=(",", ":"))
