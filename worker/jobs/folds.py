"""Folding rows into a scope's long-term memory: the model's summary (``fold``), the rows
as they are when it fails (``raw_fold``, nanobot's raw archive), and a ``new``'s fold of a
whole stored conversation before it is deleted (``fold_into_memory``). The background
consolidation jobs (``consolidation.py``) fold with these too.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from bus_redis.codec import safe
from session_store.codec import encode_meta
from session_store.models import estimate_tokens
from worker.runtime.backoff import while_full
from worker.runtime.context import Runtime

log = logging.getLogger(__name__)
FOLD_ATTEMPTS = 3  # folds of one part made again when another writer moved the memory
NEW_MAX_PARTS = 32  # of a `new` (the rest: the raw archive), each about the threshold
MIN_PART_TOKENS = 4_000  # a part's transcript is cut at 4 characters a token of the larger
# of this and the consolidation threshold
# a [RAW] archive entry at most, in UTF-8 bytes (a long conversation's newest rows): well
# under the compose file's proto-max-bulk-len of 1 MB, which a script argument must meet
RAW_MAX_BYTES = 128 * 1024  # about the unconsolidated window (AGENT_CONSOLIDATE_ABOVE_TOKENS)
RAW_CUT = "(older part cut)\n"  # where a [RAW] entry's transcript starts when it was cut
PROMPT = (
    "Summarise what is worth remembering. You keep a user's long-term memory. Given the "
    "current memory and a conversation, reply with only a JSON object "
    '{{"memory": "...", "history": "..."}}: "memory" is the updated long-term memory, the '
    "facts of the current memory and of the conversation worth keeping, newest last, in "
    'at most {budget} characters; "history" is one line saying what the conversation was '
    "about."
)


@dataclass(frozen=True, slots=True)
class Fold:
    memory: str  # the updated memory, within the budget
    history: str  # the archive entry, dated
    memory_version: int  # the memory it was made from


async def fold(
    rt: Runtime, scope: str, rows: list[dict[str, Any]], *, max_chars: int | None = None
) -> Fold:
    """Ask the model for the scope's updated memory given ``rows`` (raises what the
    provider raises); with ``max_chars``, a transcript longer than that (one row longer
    than a part) keeps its first ``max_chars`` characters."""
    budget = rt.config.memory_max_chars
    current = await rt.memory.read_memory(scope)
    version = rt.memory.version(scope)
    text = _transcript(rows)
    if max_chars is not None and len(text) > max_chars:
        text = text[:max_chars] + "\n(the rest cut)"
    user = f"# Current memory\n{current or '(empty)'}\n\n# Conversation\n{text}"
    reply = await rt.provider.chat_with_retry(
        messages=[
            {"role": "system", "content": PROMPT.format(budget=budget)},
            {"role": "user", "content": user},
        ],
        model=rt.model,
    )
    memory, history = _read(reply.content or "", current)
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M")
    return Fold(bounded(memory, budget), f"[{stamp}] {history}"[:1000], version)


async def raw_fold(rt: Runtime, scope: str, rows: list[dict[str, Any]]) -> Fold:
    """When the summary failed: the memory as it is and the rows, as they are, as one
    ``[RAW]`` entry of the scope's history archive: at most ``RAW_MAX_BYTES`` of UTF-8 in
    all, the transcript's newest bytes kept when it is longer (from wherever the cut falls:
    a newest row longer than the bound keeps its newest part)."""
    current = await rt.memory.read_memory(scope)
    version = rt.memory.version(scope)
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M")
    head = f"[{stamp}] [RAW] {len(rows)} messages\n"
    text = _transcript(rows)
    raw = text.encode()
    room = RAW_MAX_BYTES - len(head.encode())
    if len(raw) > room:  # a character the cut splits is dropped (errors="ignore")
        room -= len(RAW_CUT.encode())
        text = RAW_CUT + raw[-room:].decode(errors="ignore")
    return Fold(current or "", head + text, version)


def part_of(rows: list[dict[str, Any]], budget_tokens: int) -> list[dict[str, Any]]:
    """The first rows within ``budget_tokens`` (estimated; at least one row)."""
    used = 0
    for n, row in enumerate(rows):
        used += estimate_tokens(row)
        if used > budget_tokens and n > 0:
            return rows[:n]
    return rows


def _transcript(rows: list[dict[str, Any]]) -> str:
    return "\n".join(f"{m.get('role')}: {m.get('content')}" for m in rows)


def _read(content: str, current: str) -> tuple[str, str]:
    """``(memory, history)`` from the model's reply; a reply that is not the JSON asked
    for is taken as a summary to add to the current memory (and as the history line)."""
    raw = content.strip().removeprefix("```json").removeprefix("```").removesuffix("```")
    try:
        doc = json.loads(raw)
    except ValueError:
        doc = None
    if isinstance(doc, dict) and isinstance(doc.get("memory"), str):
        history = doc.get("history")
        line = history if isinstance(history, str) and history.strip() else "consolidated"
        memory = doc["memory"].strip() or current  # an empty answer forgets nothing
        return memory, line.strip().splitlines()[0]
    summary = content.strip()
    memory = f"{current}\n{summary}" if current and summary else current or summary
    return memory, (summary.splitlines() or ["consolidated"])[0]


def bounded(memory: str, budget: int) -> str:
    """At most ``budget`` characters, keeping the newest (last) lines whole."""
    if len(memory) <= budget:
        return memory
    tail = memory[-budget:]
    if memory[-budget - 1] == "\n":  # the tail starts on a line: whole
        return tail
    cut = tail.find("\n")  # else drop the cut line's rest
    return tail[cut + 1 :] if 0 <= cut < len(tail) - 1 else tail


async def fold_into_memory(
    rt: Runtime, key: str, token: str, member: str, holds: Callable[[], bool]
) -> str:
    """``new`` (nanobot's ``/new``): the rows of stored session ``member`` not consolidated
    yet are folded into its scope's long-term memory, fenced by the lease of ``key`` the
    caller holds, before the session is deleted: in parts of about the consolidation
    threshold each (a backlog larger than the model's context is folded all the same),
    each part committed as it is folded, ``NEW_MAX_PARTS`` at most. When a summary fails,
    or past that many parts, the rows left are archived as they are (``raw_fold``,
    nanobot's raw archive: the newest ``RAW_MAX_BYTES``). ``'ok'`` (nothing to fold counts), ``'failed'`` (nothing could be written:
    keep the session) or ``'lost'``. A write Redis refuses for memory is tried again
    while ``holds()`` (the caller's lease, not aborted), then raised."""
    budget = rt.config.consolidate_above_tokens
    cap = max(budget, MIN_PART_TOKENS) * 4  # characters (a row longer than a part)
    moved = parts = 0
    while moved < FOLD_ATTEMPTS:
        session = await rt.sessions.store.load_recent(member)
        if session is None or not session.scope:
            return "ok"  # nothing stored: a fresh conversation already
        rows = session.messages[session.last_consolidated :]
        if not rows:
            return "ok"
        try:
            if parts >= NEW_MAX_PARTS:
                raise RuntimeError(f"more than {NEW_MAX_PARTS} parts")
            part = part_of(rows, budget)
            folded = await fold(rt, session.scope, part, max_chars=cap)
        except Exception as exc:  # nanobot's raw archive: the rows as they are, not lost
            log.warning("new conversation in %s: summary failed (%s); its rows are archived "
                        "as they are", safe(member), type(exc).__name__)  # fmt: skip
            part = rows
            try:
                folded = await raw_fold(rt, session.scope, rows)
            except Exception as raw_exc:
                log.warning("new conversation in %s: archiving failed (%s); session kept",
                            safe(member), type(raw_exc).__name__)  # fmt: skip
                return "failed"
        session.last_consolidated += len(part)
        version = await rt.sessions.store.version(member)
        # a full Redis refuses it (nothing written): tried again while ``holds()``, then
        # the refusal is raised (its holder gives the lease up)
        result = await while_full(
            f"new conversation in {safe(member)}", log, holds,
            functools.partial(
                rt.bus.consolidate, key, token, meta=encode_meta(session), version=version,
                scope=session.scope, memory=folded.memory,
                memory_version=folded.memory_version, history=folded.history,
            ),
        )  # fmt: skip
        if result == "memory_moved":
            moved += 1  # (another writer of the scope's memory: this part again)
            continue
        if result != "ok":
            return result if result == "lost" else "failed"
        if len(part) == len(rows):
            return "ok"
        parts, moved = parts + 1, 0
    return "failed"
