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
the number of interrupts; one pipelined ``XRANGE`` of at most ``SCAN`` entries from the
earliest marker and one of 2 from the latest, per turn a pass. So another scope's flood
delays nothing, and the owner's interrupt is read when it is the latest one heard in a
pass or within ``SCAN`` entries of the earliest; only one both preceded by more than
``SCAN`` entries of that pass and followed by another scope's interrupt in the same pass
acts as ``queue`` (a second reading found one foreign interrupt and 63 plain messages
before the owner's enough, when only the earliest was read). The running turn's own
scope decides, never a cached copy's (it may be of an earlier conversation on the key);
a marker heard before the turn knows it waits for its load, and the table entry goes
when the turn ends (``TurnRegistry.on_end``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from bus_redis import InboundMessage, MessageRejectedError, decode_inbound
from bus_redis.codec import parse_stream_id, safe, text
from worker.runtime.context import Runtime
from worker.runtime.scopes import foreign

log = logging.getLogger(__name__)
Heard = tuple[str, str, str, str, int]  # (S, entry id, earliest marker, latest marker, count)
SCAN = 64  # stream entries read per running turn and pass, from its earliest marker heard
READ_STRETCHES = 16  # stretches of a stream remembered as read, per running turn


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
        # K -> (S, entry id, earliest marker heard, latest marker heard, interrupts heard)
        self._waiting: dict[str, Heard] = {}
        self._loading: dict[str, Heard] = {}  # ... its scope not known
        # K -> (entry id, the stretches of S read for it: from a pass's earliest marker
        # to the entry its walk reached, and each pass's latest marker): a marker in one,
        # published again, is not read again (a pub/sub flood of one interrupt costs no
        # read each); any other is (a replica's PUBLISH may come after a later marker's,
        # its marker written after a walk that ended before it: second readings, stop 52)
        self._checked: dict[str, tuple[str, list[tuple[str, str]]]] = {}
        self._task: asyncio.Task[None] | None = None
        rt.turns.on_scope = self._scope_known
        rt.turns.on_end = self._turn_ended

    def check(self, key: str, member: str, entry_id: str, marker: str) -> None:
        """K runs ``entry_id`` of S, before the interrupt ``marker``: cancel it once a
        message after a marker heard is known to be one its session takes."""
        self._prune_loading()
        checked = self._checked.get(key)
        if (
            checked
            and checked[0] == entry_id
            and any(not self._after(lo, marker) and not self._after(marker, hi)
                    for lo, hi in checked[1])
        ):  # fmt: skip
            self._refused(key, 1, "a marker already looked at")  # (read already)
            return
        self._add(self._waiting, key, (member, entry_id, marker, marker, 1))
        self._ensure_task()

    @staticmethod
    def _add(table: dict[str, Heard], key: str, new: Heard) -> None:
        old = table.get(key)
        if old is None or old[1] != new[1]:  # (another entry's: that turn is over)
            table[key] = new
            return
        earliest = min(old[2], new[2], key=parse_stream_id)
        latest = max(old[3], new[3], key=parse_stream_id)
        table[key] = (old[0], old[1], earliest, latest, old[4] + new[4])

    def waiting(self) -> int:
        """Interrupts heard and not decided yet."""
        return sum(w[4] for w in (*self._waiting.values(), *self._loading.values()))

    @staticmethod
    def _after(marker: str, seen: str) -> bool:
        return parse_stream_id(marker) > parse_stream_id(seen)

    def _turn_ended(self, key: str) -> None:
        """K's turn is done: interrupts that waited for its load are refused."""
        self._checked.pop(key, None)
        if key in self._loading:
            self._prune_loading()

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
                for key, waiting in batch.items():
                    self._refused(key, waiting[4], "reading the stream failed")
        self._prune_loading()

    def _prune_loading(self) -> None:
        """Interrupts of a turn that ended while loading its session: refused (so the
        table holds running turns only)."""
        running = self.rt.turns.running()
        for key, (member, entry_id, _, _, heard) in list(self._loading.items()):
            if running.get(key) != (member, entry_id):
                del self._loading[key]
                self._refused(key, heard, "the turn ended before its session was loaded")

    async def _check(self, batch: dict[str, Heard]) -> None:
        rt = self.rt
        read = await asyncio.gather(
            *(
                rt.bus.scripts.call("interrupts", [rt.bus.keys.inbound(w[0])], [w[2], w[3], SCAN])
                for w in batch.values()
            ),
            return_exceptions=True,
        )  # (sent together: one round trip on the worker's multiplexed connection)
        for (key, waiting), payloads in zip(batch.items(), read, strict=True):
            member, entry_id, _, latest, heard = waiting
            scope = self._scope(key, entry_id)
            if scope is None:  # heard while the turn loads its session: after the load
                self._add(self._loading, key, waiting)
                if rt.turns.scope(key, entry_id):  # (it loaded meanwhile)
                    self._scope_known(key)
                continue
            if not isinstance(payloads, BaseException) and isinstance(payloads, list):
                reached, payloads = text(payloads[0]) if payloads else "", payloads[1:]
                self._read(key, entry_id, (waiting[2], reached), (latest, latest))
            if self._carried(member, scope, payloads):
                self._apply(key, member, entry_id, "interrupt")
            else:
                self._refused(key, heard, "no message of the session's scope follows a marker")

    def _read(self, key: str, entry_id: str, *stretches: tuple[str, str]) -> None:
        """A pass read these stretches of S for K's running entry (a walk that reached
        nothing read nothing from its marker on). The newest ``READ_STRETCHES`` are kept."""
        old = self._checked.get(key)
        kept = list(old[1]) if old is not None and old[0] == entry_id else []
        kept += [(lo, hi) for lo, hi in stretches if hi and not self._after(lo, hi)]
        self._checked[key] = (entry_id, kept[-READ_STRETCHES:])

    def _scope(self, key: str, entry_id: str) -> str | None:
        """The running turn's session scope; None: not known yet (never the cached
        copy's: it may be of an earlier conversation on the key, pruned or deleted
        elsewhere, and the new one another user's)."""
        return self.rt.turns.scope(key, entry_id) or None

    def _carried(self, member: str, scope: str, payloads: Any) -> bool:
        """Whether a message right after an interrupt marker (``interrupts.lua``) is one
        the session takes."""
        if isinstance(payloads, BaseException) or not isinstance(payloads, list):
            return False
        for payload in payloads:
            try:
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
