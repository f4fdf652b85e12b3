"""Interrupts: an ``interrupt`` marker cancels a running turn only for a message that its
session would take.

A frontend that vouches no scope (each sender its own scope) lets anyone who can name a
chat send to it; the message is refused when it runs (``scopes.check_scope``), but its
interrupt marker was queued before it and would have cancelled the owner's turn first.
So before carrying out an interrupt, a worker reads the stream from the earliest
interrupt marker it heard for the turn (``FrontendClient`` writes each marker and its
message in one MULTI) and cancels when one of the markers there is followed by a message
that is not ``scopes.foreign`` to the running turn's session: a system message, or one
of the session's scope. Any other message, an entry that does not parse, no entry at all
or a failed read leaves the turn running (the messages still run after it, and are
refused or answered there). A marker heard while the turn is still loading its session
(its scope not known yet) waits for the load.

Bounds: one entry per running turn (the earliest marker heard, and how many), whatever
the number of interrupts; one pipelined ``XRANGE`` of at most ``SCAN`` entries per turn a
pass. So another scope's flood delays nothing and cannot use up the owner's interrupt
unless it puts more than ``SCAN / 2`` interrupts between the running entry's next marker
and the owner's (then the owner's acts as ``queue``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable
from typing import Any

from bus_redis import InboundMessage, MessageRejectedError, decode_inbound
from bus_redis.codec import parse_stream_id, safe
from worker.runtime.context import Runtime
from worker.runtime.scopes import foreign

log = logging.getLogger(__name__)
SCAN = 64  # stream entries read per running turn and pass, from its earliest marker heard


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
        # K -> (S, entry id, earliest marker heard, interrupts heard)
        self._waiting: dict[str, tuple[str, str, str, int]] = {}
        self._loading: dict[str, tuple[str, str, str, int]] = {}  # ... its scope not known
        self._task: asyncio.Task[None] | None = None
        rt.turns.on_scope = self._scope_known

    def check(self, key: str, member: str, entry_id: str, marker: str) -> None:
        """K runs ``entry_id`` of S, before the interrupt ``marker``: cancel it once a
        message after a marker heard is known to be one its session takes."""
        self._prune_loading()
        self._add(self._waiting, key, (member, entry_id, marker, 1))
        self._ensure_task()

    @staticmethod
    def _add(
        table: dict[str, tuple[str, str, str, int]], key: str, new: tuple[str, str, str, int]
    ) -> None:
        old = table.get(key)
        if old is None or old[1] != new[1]:  # (another entry's: that turn is over)
            table[key] = new
            return
        earliest = min(old[2], new[2], key=parse_stream_id)
        table[key] = (old[0], old[1], earliest, old[3] + new[3])

    def waiting(self) -> int:
        """Interrupts heard and not decided yet."""
        return sum(w[3] for w in (*self._waiting.values(), *self._loading.values()))

    def _scope_known(self, key: str) -> None:
        """K's turn loaded its session: interrupts that waited for its scope are read."""
        held = self._loading.pop(key, None)
        if held is not None:
            self._add(self._waiting, key, held)
            self._ensure_task()

    def _ensure_task(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def settled(self) -> None:
        """Until every interrupt heard so far is carried out, refused or waiting for its
        turn's session to load."""
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)

    async def _run(self) -> None:
        while self._waiting:
            batch, self._waiting = self._waiting, {}
            try:
                await self._check(batch)
            except Exception as exc:  # the safe side: the turns go on, later checks too
                log.warning("checking interrupts failed (%s): not carried out", type(exc).__name__)
                for key, (_, _, _, heard) in batch.items():
                    self._refused(key, heard, "reading the stream failed")
        self._prune_loading()

    def _prune_loading(self) -> None:
        """Interrupts of a turn that ended while loading its session: refused (so the
        table holds running turns only)."""
        running = self.rt.turns.running()
        for key, (member, entry_id, _, heard) in list(self._loading.items()):
            if running.get(key) != (member, entry_id):
                del self._loading[key]
                self._refused(key, heard, "the turn ended before its session was loaded")

    async def _check(self, batch: dict[str, tuple[str, str, str, int]]) -> None:
        rt = self.rt
        async with rt.bus.raw.pipeline(transaction=False) as pipe:
            for member, _, marker, _ in batch.values():
                pipe.xrange(rt.bus.keys.inbound(member), marker, "+", count=SCAN)
            replies = await pipe.execute(raise_on_error=False)
        for (key, waiting), reply in zip(batch.items(), replies, strict=True):
            member, entry_id, _, heard = waiting
            scope = self._scope(key, entry_id)
            if scope is None:  # heard while the turn loads its session: after the load
                self._add(self._loading, key, waiting)
                if rt.turns.scope(key, entry_id):  # (it loaded meanwhile)
                    self._scope_known(key)
                continue
            if self._carried(member, scope, reply):
                self._apply(key, member, entry_id, "interrupt")
            else:
                self._refused(key, heard, "no message of the session's scope follows a marker")

    def _scope(self, key: str, entry_id: str) -> str | None:
        """The running turn's session scope (not the cache's copy: it may have let it go);
        before the turn loaded it, the cached copy's; None: not known yet."""
        scope = self.rt.turns.scope(key, entry_id)
        if scope:
            return scope
        session = self.rt.sessions.get_cached(key)
        return session.scope if session is not None and session.scope else None

    def _carried(self, member: str, scope: str, reply: Any) -> bool:
        """Whether an interrupt marker among the entries read is followed by a message the
        session takes."""
        if isinstance(reply, Exception) or not reply:
            return False
        for (_, marker), (_, after) in itertools.pairwise(reply):
            if dict(marker).get(b"control") != b"interrupt":
                continue
            try:
                payload = dict(after).get(b"payload") or b""
                msg = decode_inbound(payload, max_bytes=self.rt.config.max_payload_bytes)
            except MessageRejectedError:
                continue
            if (
                isinstance(msg, InboundMessage)
                and msg.session_key == member
                and not foreign(self.rt, msg, scope)
            ):
                return True
        return False

    def _refused(self, key: str, heard: int, why: str) -> None:
        self._forget(key)
        self.rt.metrics.interrupts_refused.inc(heard)  # (a flood is counted, not logged)
        log.debug("%d interrupt(s) of %s not carried out: %s", heard, safe(key), why)

    async def close(self) -> None:
        self.rt.turns.on_scope = None
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
