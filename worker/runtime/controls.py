"""Controls: what a worker does with a stop, discard or delete that reached it over pub/sub.

The pub/sub message only says "look": a turn is cancelled once a marker is confirmed
queued after the entry it runs (so a late message of an earlier control never cancels a
newer turn), and a control that finds no entry being handled is remembered briefly for an
entry that may be between its selection and its registration.

A flood costs O(1): the listener only marks the session as "to look at" (a set, so any
number of controls for one session is one look) and one task confirms all marked
sessions per round trip. Only sessions running here are marked (at most the worker's
concurrency); a control for anything else is remembered in a bounded per-channel table.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from bus_redis import ControlMessage
from bus_redis.codec import parse_stream_id
from worker.runtime.context import Runtime
from worker.runtime.interrupts import Interrupts

log = logging.getLogger(__name__)
FORGETTING = ("discard", "delete", "new")  # ops that make a worker forget the session


class Controls:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self._marked: set[str] = set()  # effective keys of running turns to look at
        self._resume: dict[tuple[str, str], str] = {}  # (K, entry id) -> where a look goes on
        self._heard: dict[str, float] = {}  # K -> when its first unconfirmed control came
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._drops: set[asyncio.Task[None]] = set()  # owner records being dropped
        self.interrupts = Interrupts(rt, self._apply, lambda key: self._heard.pop(key, None))

    def on_control(self, control: ControlMessage) -> None:
        """A stop / discard / delete for session S (called by the control subscription)."""
        rt, target = self.rt, control.session_key
        running = {k: v for k, v in rt.turns.running().items() if target in (k, v[0])}
        if running:
            now = time.monotonic()
            for key in running:
                self._heard.setdefault(key, now)
        if running and control.marker:
            running = self._by_marker(running, target, control.op, control.marker)
        if running:
            self._marked.update(running)
            self._wake.set()
            self._ensure_task()
        else:  # an entry may be between select and begin
            rt.turns.note_control(target)
        if control.op in FORGETTING and not rt.sessions.is_transient(target):
            rt.sessions.invalidate(target)
        # A private session is forgotten (and its owner record dropped) when its holder
        # reaches the discard marker: exactly in stream order, under its lease.

    def look(self, key: str) -> None:
        """Look for a marker after K's running entry: a control heard while nothing ran
        here raced its selection. In the confirming pass, which looks again when Redis
        failed it (a look of its own was lost with its error, and the control with it)."""
        self._marked.add(key)
        self._wake.set()
        self._ensure_task()

    def _by_marker(
        self, running: dict[str, tuple[str, str]], target: str, op: str, marker: str
    ) -> dict[str, tuple[str, str]]:
        """The control names its marker in S's stream: a turn of an entry of S before it is
        covered, so it is cancelled now, without reading the stream; a turn of a later
        entry is not (that marker was consumed before the entry was selected). Returns the
        turns still to look at (a folded key running an entry of another stream)."""
        left: dict[str, tuple[str, str]] = {}
        for key, (member, entry_id) in running.items():
            if not entry_id or member != target:
                left[key] = (member, entry_id)
            elif parse_stream_id(entry_id) >= parse_stream_id(marker):
                self._heard.pop(key, None)
            elif op == "interrupt" and not self.rt.config.owner_mode:
                self.interrupts.check(key, member, entry_id, marker)  # (only for its scope)
            else:
                self._apply(key, member, entry_id, op)
        return left

    def _apply(self, key: str, member: str, entry_id: str, op: str) -> bool:
        """Cancel K's turn of ``entry_id`` for ``op``; True when it was still running it.
        A forgetting op also forgets the session here (and its owner record, see
        :meth:`_forget`)."""
        rt = self.rt
        cancelled = rt.turns.cancel_entry(key, entry_id, op)
        heard = self._heard.pop(key, None)
        if cancelled and heard is not None:
            rt.metrics.cancel_seconds.observe(time.monotonic() - heard)
        if cancelled and op in FORGETTING:
            owned = rt.turns.disown(member)
            rt.sessions.invalidate(member)
            if owned is not None:  # (its holder, at the marker: a new of it is a discard)
                rt.turns.ended_by_control(member)
                task = asyncio.get_running_loop().create_task(rt.drop_owner(member, owned))
                self._drops.add(task)
                task.add_done_callback(self._drops.discard)
        return bool(cancelled)

    def _ensure_task(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._confirm_marked())

    async def _confirm_marked(self) -> None:
        """Confirm marked sessions, all of them in one pipelined round trip per pass,
        until none is left (controls arriving meanwhile join the next pass)."""
        while self._marked:
            self._wake.clear()
            marked, self._marked = self._marked, set()
            running = {k: v for k, v in self.rt.turns.running().items() if k in marked}
            try:
                await self.confirm_and_cancel(running)
            except Exception:  # a failed pass must not stop later controls
                log.warning("confirming controls failed; looking again", exc_info=True)
                self._marked |= marked
                await asyncio.sleep(0.05)

    async def confirm_and_cancel(self, running: dict[str, tuple[str, str]]) -> None:
        """One bounded step of looking for a marker after each running entry; cancel those
        a marker covers (a discard also forgets the session at once: exact, the marker
        follows the entry this worker runs under the lease). A turn whose look read its
        whole budget without an answer is looked at again in the next pass, so one
        session's long queue never holds back another's stop."""
        rt = self.rt
        resume = {k: self._resume.get((k, v[1]), "") for k, v in running.items()}
        markers, again = await rt.registry.markers_step(running, resume)
        for key, op in markers.items():
            member, entry_id = running[key]
            self._apply(key, member, entry_id, op)
        if self._drops:
            await asyncio.gather(*self._drops, return_exceptions=True)
        for key, where in again.items():
            self._resume[(key, running[key][1])] = where
        current = {(k, v[1]) for k, v in rt.turns.running().items()}
        self._resume = {kv: w for kv, w in self._resume.items() if kv in current}  # bounded
        looking = ({k for k, _ in current} & set(again)) | self._marked  # answered: afresh
        self._heard = {k: t for k, t in self._heard.items() if k in looking}
        if again:
            self._marked.update(again)
            self._wake.set()
            self._ensure_task()

    async def check_missed(self) -> None:
        """After (re)subscribing: apply controls published while we were not listening."""
        await self.confirm_and_cancel(self.rt.turns.running())

    async def close(self) -> None:
        await self.interrupts.close()
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
