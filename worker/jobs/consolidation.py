"""Token-based consolidation: fold old messages of a durable session into its scope's
long-term memory.

Runs in the background, deduplicated per session, never for transient sessions. The
summary is made without the lease (the LLM call may be slow); then, under the lease,
``consolidate.lua`` appends it to the scope's memory and moves ``last_consolidated`` in
one fenced step: a worker without the lease writes nothing, and two consolidations of
the same scope both keep their facts (memory is appended, never read-modify-written).
"""

from __future__ import annotations

import logging

from bus_redis.codec import safe
from session_store import Session
from session_store.codec import encode_meta
from worker.runtime.acquiring import Acquirer
from worker.runtime.context import Runtime

log = logging.getLogger(__name__)
KEEP_RECENT = 8
PROMPT = "Summarise the facts worth remembering from this conversation in a few short lines."
JOB_NAME = "consolidate"


class Consolidator:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    async def maybe_consolidate_by_tokens(self, session: Session) -> bool:
        """Queue a consolidation job when the unconsolidated history is over budget
        (at most one per session at a time; never for transient sessions)."""
        if not session.policy.persist or not session.scope:
            return False
        if session.token_count <= self.rt.config.consolidate_above_tokens:
            return False
        end = len(session.messages) - KEEP_RECENT
        if end <= session.last_consolidated:
            return False
        return await self.rt.jobs.enqueue(
            JOB_NAME,
            job_id=f"{self.rt.bus.keys.prefix}:{JOB_NAME}:{session.key}",
            key=session.key,
            start=session.last_consolidated,
            end=end,
        )

    async def run_job(self, *, key: str, start: int, end: int) -> None:
        """The job: summarise rows ``start:end`` of a stored session into its memory."""
        snapshot = await self.rt.sessions.store.load(key)
        if snapshot is None or snapshot.last_consolidated != start or not snapshot.scope:
            return  # gone, transient (never stored), or consolidated meanwhile
        text = "\n".join(
            f"{m.get('role')}: {m.get('content')}" for m in snapshot.messages[start:end]
        )
        summary = await self.rt.provider.chat_with_retry(
            messages=[{"role": "system", "content": PROMPT}, {"role": "user", "content": text}],
            model=self.rt.model,
        )
        await self._commit(key, start, end, summary.content or "")

    async def _commit(self, key: str, start: int, end: int, summary: str) -> None:
        acquired, _scope = await Acquirer(self.rt).acquire_blocking(key)
        try:
            session = await self.rt.sessions.load_for_turn(
                key, acquired.version, acquired.generation
            )
            if session.last_consolidated != start or len(session.messages) < end:
                return
            session.last_consolidated = end
            result = await self.rt.bus.consolidate(
                key,
                acquired.token,
                meta=encode_meta(session),
                version=acquired.version,
                summary=summary,
                memory_key=self.rt.memory.key(session.scope),
            )
            if result != "ok":
                self.rt.sessions.invalidate(key)
                log.warning("consolidation of %s not committed: %s", safe(key), result)
            else:
                self.rt.sessions.invalidate(key)  # reload: version and memory moved
        finally:
            await self.rt.bus.release(key, acquired.token)


async def fold_into_memory(rt: Runtime, key: str, token: str, member: str) -> str:
    """``new`` (nanobot's ``/new``): the rows of stored session ``member`` not consolidated
    yet are summarised into its scope's long-term memory, fenced by the lease of ``key``
    the caller holds, before the session is deleted. ``'ok'`` (nothing to fold counts),
    ``'failed'`` (the summary failed: keep the session) or ``'lost'`` (the lease)."""
    session = await rt.sessions.store.load(member)
    if session is None or not session.scope:
        return "ok"  # nothing stored: a fresh conversation already
    rows = session.messages[session.last_consolidated :]
    if not rows:
        return "ok"
    text = "\n".join(f"{m.get('role')}: {m.get('content')}" for m in rows)
    try:
        summary = await rt.provider.chat_with_retry(
            messages=[{"role": "system", "content": PROMPT}, {"role": "user", "content": text}],
            model=rt.model,
        )
    except Exception as exc:
        log.warning("new conversation in %s: summary failed (%s); session kept",
                    safe(member), type(exc).__name__)  # fmt: skip
        return "failed"
    session.last_consolidated = len(session.messages)
    result = await rt.bus.consolidate(
        key,
        token,
        meta=encode_meta(session),
        version=await rt.sessions.store.version(member),
        summary=summary.content or "",
        memory_key=rt.memory.key(session.scope),
    )
    return result if result in ("ok", "lost") else "failed"
