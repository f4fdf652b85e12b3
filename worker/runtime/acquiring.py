"""Acquiring leases: which key, which memory version, and waiting for a busy one.

``Acquirer.acquire`` takes the lease of an effective key for a notification (retrying
with the stream's own key when acquire answers that the stream is a private session, and
with the unified key again when that private session ended meanwhile); ``acquire_blocking`` waits (with backoff) for a key held by a
running turn, for the in-process API and consolidation.
"""

from __future__ import annotations

import asyncio

from bus_redis.results import (
    Acquired,
    AcquireResult,
    Fold,
    Forward,
    Gone,
    Notification,
    Private,
)
from session_store import OWNER_SCOPE, UNIFIED_SESSION_KEY
from worker.runtime.context import Runtime
from worker.runtime.outcomes import SessionNotActiveError


class Acquirer:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    def effective_key(self, session_key: str) -> str:
        """Unified mode folds every durable session into one; a private session (open
        here, or found by acquire from its owner record) stays out."""
        if self.rt.config.unified_session and not self.rt.sessions.is_transient(session_key):
            return UNIFIED_SESSION_KEY
        return session_key

    def memory_scope(self, key: str) -> str:
        """The scope whose memory version acquire reads: the (once) cached session's."""
        if self.rt.config.owner_mode:
            return OWNER_SCOPE
        if self.rt.sessions.is_transient(key):
            return ""
        return self.rt.sessions.scope_hint(key)

    async def acquire(
        self, key: str, *, member: str = "", select: bool = True, note: Notification | None = None
    ) -> tuple[str, AcquireResult, str]:
        """``(key, result, memory scope)``: K, or S when S is private or held on its own."""
        rt = self.rt
        if rt.turns.redropping():  # (rare: a drop failed) a record naming this worker,
            # which forgot the session, goes first: never a turn run under it (in unified
            # mode a durable one under the private key's own lease)
            redrops = rt.turns.redrops()
            for stream in {key, member} & redrops.keys():
                await rt.drop_owner(stream, redrops[stream], later=False)
        while True:
            scope = self.memory_scope(key)
            transient = rt.sessions.is_transient(key) and not rt.turns.is_closing(key)
            # a session opened over the wire (owned) has had its record since its opening
            # commit: one missing now was lost; any other (opening, or made in process by
            # process_message) claims the record
            held = transient and rt.turns.owns(key) and not rt.turns.is_opening(key)
            result = await rt.bus.acquire(
                key,
                rt.worker_id,
                member=member,
                claim_owner=transient and not held,
                held_owner=held,
                select=select,
                note=note,
                memory_key=rt.memory.key(scope) if scope else "",
                # a lease taken to run a turn reads what the cached copy lacks with it
                cached=rt.sessions.cached_for_acquire(key) if select and not transient else None,
                fold=UNIFIED_SESSION_KEY if rt.config.unified_session else "",
            )
            if isinstance(result, Gone):  # lost while this worker stalled: never revived
                if rt.turns.is_opening(key):
                    continue  # opened again meanwhile: its commit writes the record
                rt.lost(key)  # as the renewal does
            elif isinstance(result, Private):
                key = member
            elif isinstance(result, Fold):  # a private session that ended meanwhile
                key = UNIFIED_SESSION_KEY
            else:
                return key, result, scope

    async def acquire_blocking(self, key: str) -> tuple[Acquired, str]:
        """Wait for the lease of ``key`` while another holder runs a turn."""
        delay_s = 0.005
        while True:
            _, result, scope = await self.acquire(key, select=False)
            if isinstance(result, Acquired):
                return result, scope
            if isinstance(result, Forward):
                raise SessionNotActiveError(f"session is owned by worker {result.owner}")
            await asyncio.sleep(delay_s)  # the lease is held by a running turn: back off
            delay_s = min(delay_s * 2, 0.1)
