"""Interrupts: an ``interrupt`` marker cancels a running turn only for a message that its
session would take.

A frontend that vouches no scope (each sender its own scope) lets anyone who can name a
chat send to it; the message is refused when it runs (``scopes.check_scope``), but its
interrupt marker was queued before it and would have cancelled the owner's turn first.
So before carrying out an interrupt, a worker reads the entry queued right after the
marker (``FrontendClient`` writes both in one MULTI) and cancels only when that message
is not ``scopes.foreign`` to the session: a system message, or one whose scope is the
session's. Anything else — no such entry, a payload that does not parse, another
scope, a failed read — leaves the turn running (the message itself still runs after it,
and is refused or answered there).

Bounds: at most ``PER_KEY`` checks wait per running turn (a flood of interrupts for one
session beyond that is refused, not queued), and running turns are at most the worker's
concurrency; all waiting checks are read in one pipelined round trip per pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from bus_redis import InboundMessage, MessageRejectedError, decode_inbound
from bus_redis.codec import safe
from worker.runtime.context import Runtime
from worker.runtime.scopes import foreign

log = logging.getLogger(__name__)
PER_KEY = 8  # checks waiting per running turn


class Interrupts:
    def __init__(
        self,
        rt: Runtime,
        apply: Callable[[str, str, str, str], bool],
        forget: Callable[[str], object],
    ) -> None:
        self.rt = rt
        self._apply = apply  # Controls._apply(key, member, entry id, op)
        self._forget = forget  # K's control was answered without a cut
        self._waiting: dict[str, dict[str, tuple[str, str]]] = {}  # K -> {marker: (S, id)}
        self._task: asyncio.Task[None] | None = None

    def check(self, key: str, member: str, entry_id: str, marker: str) -> None:
        """K runs ``entry_id`` of S, before the interrupt ``marker``: cancel it once the
        message after the marker is known to be one its session takes."""
        waiting = self._waiting.setdefault(key, {})
        if len(waiting) >= PER_KEY:
            self._refused(key, "too many interrupts waiting")
            return
        waiting[marker] = (member, entry_id)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    def waiting(self) -> int:
        return sum(len(markers) for markers in self._waiting.values())

    async def settled(self) -> None:
        """Until every interrupt heard so far is carried out or refused."""
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)

    async def _run(self) -> None:
        while self._waiting:
            batch, self._waiting = self._waiting, {}
            try:
                await self._check(batch)
            except Exception as exc:  # the safe side: the turns go on, later checks too
                log.warning("checking interrupts failed (%s): not carried out", type(exc).__name__)
                for key, markers in batch.items():
                    for _ in markers:
                        self._refused(key, "reading the stream failed")

    async def _check(self, batch: dict[str, dict[str, tuple[str, str]]]) -> None:
        rt = self.rt
        todo = [(k, marker, v) for k, markers in batch.items() for marker, v in markers.items()]
        async with rt.bus.raw.pipeline(transaction=False) as pipe:
            for _, marker, (member, _) in todo:
                pipe.xrange(rt.bus.keys.inbound(member), f"({marker}", "+", count=1)
            replies = await pipe.execute(raise_on_error=False)
        for (key, _, (member, entry_id)), reply in zip(todo, replies, strict=True):
            why = self._refusal(key, member, entry_id, reply)
            if why:
                self._refused(key, why)
            else:
                self._apply(key, member, entry_id, "interrupt")

    def _refusal(self, key: str, member: str, entry_id: str, reply: Any) -> str:
        """Why the message after the marker may not interrupt K's turn ('' when it may)."""
        if isinstance(reply, Exception) or not reply:
            return "no message follows the marker"
        payload = dict(reply[0][1]).get(b"payload")
        try:
            msg = decode_inbound(payload or b"", max_bytes=self.rt.config.max_payload_bytes)
        except MessageRejectedError:
            return "the message after the marker is not valid"
        if not isinstance(msg, InboundMessage) or msg.session_key != member:
            return "the entry after the marker is not a message of the session"
        # the running turn's session (not the cache's: it may have let it go meanwhile);
        # before the turn loaded it, the cached copy's
        scope = self.rt.turns.scope(key, entry_id)
        if not scope:
            session = self.rt.sessions.get_cached(key)
            if session is None or not session.scope:
                return "the running turn's session is not known here yet"
            scope = session.scope
        if foreign(self.rt, msg, scope):
            return "the message is for another scope than the session's"
        return ""

    def _refused(self, key: str, why: str) -> None:
        self._forget(key)
        self.rt.metrics.interrupts_refused.inc()  # (a flood is counted, not logged line by line)
        log.debug("interrupt of %s not carried out: %s", safe(key), why)

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
