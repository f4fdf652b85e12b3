"""What a discard, new or delete marker does to the session its holder reached it in:
forget the session here (a private one is gone, its owner record dropped); a ``new``
folds the stored history into memory first (in unified mode the shared session's), and
a ``delete`` or ``new`` removes the stored session and its events, fenced by the lease
the holder runs under."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from bus_redis.codec import safe
from bus_redis.journal import JournalStore
from session_store import UNIFIED_SESSION_KEY
from worker.jobs.folds import fold_into_memory
from worker.runtime.backoff import while_full

if TYPE_CHECKING:
    from worker.runtime.holder import SessionHolder

log = logging.getLogger(__name__)


async def forget(holder: SessionHolder, member: str, op: str, marker: str) -> None:
    """A discard, new or delete reached stream ``member``: forget its session (a private
    one is gone); a delete also removes the stored session and its events, a new folds
    the stored history into memory first (in unified mode the shared session's), fenced
    by the lease this holder runs under."""
    owned = holder.rt.turns.disown(member)
    # a private session ended already by this control (its running turn cancelled)
    private = holder.rt.turns.take_ended(member) or owned is not None
    holder.rt.sessions.invalidate(member)
    if owned is not None:
        await holder.rt.drop_owner(member, owned)
    # a new conversation starts where the chat's history is stored: in unified mode the
    # shared session (nanobot's /new there); a delete removes the chat's own session
    stored = holder.key if op == "new" and holder.key == UNIFIED_SESSION_KEY else member
    # unified mode: a private session's new is a discard, also once it ended, and also
    # when a later holder of its own key reaches the marker (not the one it ended on:
    # that one knows, ``take_ended``), where it would delete the key's events as a
    # durable new does, the cancelled answers of what the session's end cut included
    unified = holder.rt.config.unified_session  # (only unified mode marks private keys)
    if op == "new" and not private and unified and await holder.rt.registry.was_private(member):
        return
    if op == "new" and not private and stored == member and marker:
        # per-session mode: published before the private session last open on the
        # key ended (a control ended it on a worker that then handed the lease over,
        # or its worker was killed)
        private = await holder.rt.registry.new_was_private(member, marker)
    if op == "new" and not private:
        holder.rt.sessions.invalidate_stored(stored)
        folded = await fold_into_memory(holder.rt, holder.key, holder.token, stored, holder.waits)
        if folded == "lost":
            holder.lease.lost = True
        if folded != "ok":
            return  # nothing written (not even the rows as they are): kept, not lost
        holder.memory_scope = ""  # the next turn under this lease reads the folded memory
    if op == "delete" or (op == "new" and not private):
        # its events go, but for the error answers written after the marker (the
        # cancelled answers of what it covered), for the frontend to read. A delete
        # also removes the stored session a private one was opened over
        lease, store = holder.rt.bus.keys.lease(holder.key), holder.rt.sessions.store
        deleted = await while_full(
            f"delete of {safe(stored)}", log, holder.waits,
            lambda: store.delete_held(stored, lease, holder.token, events_before=marker),
        )  # fmt: skip
        if deleted < 0:
            holder.lease.lost = True
    if member != holder.key and op in ("delete", "new", "discard"):
        # a folded chat's turns journal under the unified lease: a crashed turn's
        # journal of this chat goes with it (delete.lua drops the chat's own key only)
        journals = JournalStore(holder.rt.bus)
        await while_full(
            f"dropping a journal of {safe(member)}", log, holder.waits,
            lambda: journals.drop_of(holder.key, holder.token, member),
        )  # fmt: skip
