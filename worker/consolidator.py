"""Token-based consolidation: fold old messages of a durable session into memory.

Runs in the background, deduplicated per session, never for transient sessions. The
summary is made without the lease (the LLM call may be slow); the result is committed
under the lease and only if nobody consolidated the same range meanwhile.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from bus_redis.results import CommitSpec
from session_store import Session
from session_store.codec import encode_meta

if TYPE_CHECKING:
    from worker.loop import AgentLoop

log = logging.getLogger(__name__)
KEEP_RECENT = 8
PROMPT = "Summarise the facts worth remembering from this conversation in a few short lines."


JOB_NAME = "consolidate"


class Consolidator:
    def __init__(self, loop: AgentLoop) -> None:
        self.loop = loop

    async def maybe_consolidate_by_tokens(self, session: Session) -> bool:
        """Queue a consolidation job when the unconsolidated history is over budget
        (at most one per session at a time; never for transient sessions)."""
        if not session.policy.persist:
            return False
        if session.token_count <= self.loop.config.consolidate_above_tokens:
            return False
        end = len(session.messages) - KEEP_RECENT
        if end <= session.last_consolidated:
            return False
        return await self.loop.jobs.enqueue(
            JOB_NAME,
            job_id=f"{self.loop.bus.keys.prefix}:{JOB_NAME}:{session.key}",
            key=session.key,
            start=session.last_consolidated,
            end=end,
        )

    async def run_job(self, *, key: str, start: int, end: int) -> None:
        """The job: summarise rows ``start:end`` of a stored session into memory."""
        snapshot = await self.loop.sessions.store.load(key)
        if snapshot is None or snapshot.last_consolidated != start:
            return  # gone, transient (never stored), or consolidated meanwhile
        text = "\n".join(
            f"{m.get('role')}: {m.get('content')}" for m in snapshot.messages[start:end]
        )
        summary = await self.loop.provider.chat_with_retry(
            messages=[{"role": "system", "content": PROMPT}, {"role": "user", "content": text}],
            model=self.loop.model,
        )
        await self._commit(key, start, end, summary.content or "")

    async def _commit(self, key: str, start: int, end: int, summary: str) -> None:
        acquired = await self.loop._acquire_blocking(key)
        try:
            session = await self.loop.sessions.load_for_turn(key, acquired.version)
            if session.last_consolidated != start or len(session.messages) < end:
                return
            memory = await self.loop.memory.read_memory()
            await self.loop.memory.write_memory(f"{memory}\n{summary}".strip())
            session.last_consolidated = end
            spec = CommitSpec(member=key, meta=encode_meta(session))
            version, _ = await self.loop.bus.commit(
                key, acquired.token, self.loop.worker_id, spec, select=None
            )
            if version >= 0:
                session.version = version
        finally:
            await self.loop.bus.release(key, acquired.token)
