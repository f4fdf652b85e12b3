"""TurnRegistry: the one owner of a worker's in-flight state.

Per effective key K: the holder draining it, the entry being handled (stream S and entry
id, registered *before* the session is loaded), the turn task once it exists, and a
cancel reason. A control that arrives at any point of that sequence is kept and applied
as soon as there is a task to cancel, so it can never miss a turn being set up. Also the
transient sessions this worker owns, and the worker's counters. Everything is removed
when its session ends; nothing else below the loop keeps per-session state.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

RECENT_PER_CHANNEL = 1024  # controls remembered per channel for entries not yet begun


@dataclass(slots=True)
class Slot:
    """What is going on for one effective key."""

    key: str
    member: str = ""  # stream S of the entry being handled
    entry_id: str = ""
    task: asyncio.Task[Any] | None = None
    reason: str | None = None  # why the turn is (to be) cancelled
    scope: str = ""  # its session's scope, once the turn loaded it


class TurnRegistry:
    def __init__(self) -> None:
        self._slots: dict[str, Slot] = {}
        self.on_scope: Callable[[str], None] | None = None  # a turn's session scope known
        self.on_end: Callable[[str], None] | None = None  # a turn's entry is done
        self._owned: dict[str, str] = {}  # transient key -> owners-registry member
        self._used: dict[str, float] = {}  # transient key -> last use (monotonic s)
        self._opening: set[str] = set()  # transient keys whose opening commit is on its way
        # private sessions a control ended while their turn ran, their marker not reached
        # yet: there, its op is the private session's (a new: a discard). Bounded by the
        # holders running here: a holder forgets its own when it ends
        self._ended: set[str] = set()
        self._closing: set[str] = set()  # transient keys being closed (never claimed again)
        self._epoch: dict[str, int] = {}  # transient key -> which session of it (own())
        self._epochs = 0
        self._redrop: dict[str, str] = {}  # forgotten sessions whose record's drop failed
        # per channel: controls with no slot yet (session -> when)
        self._recent: dict[str, OrderedDict[str, float]] = {}
        self.metrics: Counter[str] = Counter()  # leases_lost, fenced_writes_rejected, ...
        self.stopping = False

    # --- entries and turns ----------------------------------------------------------
    def begin(self, key: str, member: str, entry_id: str) -> Slot:
        """An entry of K is being handled (before its session is loaded)."""
        slot = Slot(key, member, entry_id)
        self._slots[key] = slot
        return slot

    @staticmethod
    def attach(slot: Slot, task: asyncio.Task[Any]) -> None:
        """The turn task of ``slot``'s entry exists; a control that came meanwhile cancels
        it now."""
        slot.task = task
        if slot.reason is not None:
            task.cancel()

    def set_scope(self, slot: Slot, scope: str) -> None:
        """``slot``'s turn loaded its session (``on_scope``: interrupts waiting for it)."""
        slot.scope = scope
        if scope and self.on_scope is not None and self._slots.get(slot.key) is slot:
            self.on_scope(slot.key)

    def scope(self, key: str, entry_id: str) -> str:
        """The scope of the session K's turn of ``entry_id`` runs in ('' until loaded)."""
        slot = self._slots.get(key)
        return slot.scope if slot is not None and slot.entry_id == entry_id else ""

    def reason(self, key: str) -> str | None:
        slot = self._slots.get(key)
        return slot.reason if slot else None

    def end(self, key: str, slot: Slot | None = None) -> str | None:
        """The entry of K is done; returns the cancel reason, if any. With ``slot`` (what
        :meth:`begin` returned), only that slot is ended: a holder that let its lease go
        may still be finishing while a newer one of K has begun."""
        current = self._slots.get(key)
        if current is None or (slot is not None and current is not slot):
            return None
        del self._slots[key]
        if self.on_end is not None:
            self.on_end(key)
        return current.reason

    def cancel(self, target: str, reason: str) -> int:
        """Cancel the turn of K == target, or of the entry of stream S == target."""
        n = 0
        for slot in list(self._slots.values()):
            if target in (slot.key, slot.member):
                n += self._cancel(slot, reason)
        return n

    def cancel_slot(self, slot: Slot, reason: str) -> int:
        """Cancel the entry of ``slot`` (what :meth:`begin` returned) alone."""
        return self._cancel(slot, reason)

    def cancel_entry(self, key: str, entry_id: str, reason: str) -> int:
        """Cancel K's turn only if it still handles ``entry_id`` (a confirmation that
        arrives late never cancels the next turn)."""
        slot = self._slots.get(key)
        return self._cancel(slot, reason) if slot and slot.entry_id == entry_id else 0

    # --- controls that found no slot ----------------------------------------------------
    def note_control(self, target: str, *, keep_s: float = 5.0) -> None:
        """A control for a session with no entry being handled here: an entry selected
        just before the marker was queued may still be on its way to :meth:`begin`.
        At most RECENT_PER_CHANNEL are kept per channel (a flood of controls for sessions
        that run nowhere forgets the oldest of its own channel only)."""
        now = time.monotonic()
        recent = self._recent.setdefault(target.partition(":")[0], OrderedDict())
        recent.pop(target, None)
        recent[target] = now
        while recent and (
            len(recent) > RECENT_PER_CHANNEL or next(iter(recent.values())) < now - keep_s
        ):
            recent.popitem(last=False)

    def take_recent(self, *targets: str, keep_s: float = 5.0) -> bool:
        """Whether a control for one of ``targets`` came recently (forgetting it)."""
        now = time.monotonic()
        found = False
        for t in targets:
            recent = self._recent.get(t.partition(":")[0])
            if recent is not None and now - recent.pop(t, -keep_s - 1) <= keep_s:
                found = True
        return found

    @staticmethod
    def _cancel(slot: Slot, reason: str) -> int:
        if slot.reason is None:
            slot.reason = reason
        if slot.task is not None and not slot.task.done():
            slot.task.cancel()
        return 1

    def running(self) -> dict[str, tuple[str, str]]:
        """``{K: (S, entry id)}`` of every entry being handled."""
        return {k: (s.member, s.entry_id) for k, s in self._slots.items() if s.member}

    def active_tasks(self) -> dict[str, asyncio.Task[Any]]:
        return {k: s.task for k, s in self._slots.items() if s.task is not None}

    def __len__(self) -> int:
        return len(self._slots)

    # --- transient sessions this worker owns -------------------------------------------
    def own(self, key: str, member: str, *, opening: bool = False) -> None:
        """``opening``: its owner record is written by a commit still to come (until
        :meth:`opened`, a renewal that finds no record is no sign of its loss)."""
        self._owned[key] = member
        self._used[key] = time.monotonic()
        self._epochs += 1
        self._epoch[key] = self._epochs
        self._redrop.pop(key, None)  # the record is ours again: never dropped by a retry
        if opening:  # (opened again while being closed: the close leaves it alone)
            self._opening.add(key)
            self._closing.discard(key)

    def opened(self, key: str) -> None:
        self._opening.discard(key)
        self._closing.discard(key)

    def is_opening(self, key: str) -> bool:
        return key in self._opening

    def closing(self, key: str, on: bool) -> None:
        if on:
            self._closing.add(key)
        else:
            self._closing.discard(key)

    def is_closing(self, key: str) -> bool:
        return key in self._closing

    def epoch(self, key: str) -> int | None:
        """Which of the key's private sessions this worker holds (a reopening is another)."""
        return self._epoch.get(key)

    def redrop(self, key: str, member: str) -> None:
        self._redrop[key] = member

    def redropping(self) -> bool:
        return bool(self._redrop)

    def redrops(self) -> dict[str, str]:
        return dict(self._redrop)

    def dropped(self, key: str) -> None:
        self._redrop.pop(key, None)

    def touch(self, key: str) -> None:
        if key in self._owned:
            self._used[key] = time.monotonic()

    def idle(self, older_than_s: float) -> list[str]:
        """Owned sessions not used for ``older_than_s`` and not being served now."""
        cutoff = time.monotonic() - older_than_s
        return [k for k, t in self._used.items() if t < cutoff and k not in self._slots]

    def is_idle(self, key: str, older_than_s: float) -> bool:
        used = self._used.get(key)
        return (
            used is not None and used < time.monotonic() - older_than_s and key not in self._slots
        )

    def disown(self, key: str) -> str | None:
        self._used.pop(key, None)
        self._epoch.pop(key, None)
        self._opening.discard(key)
        return self._owned.pop(key, None)

    def ended_by_control(self, key: str) -> None:
        self._ended.add(key)

    def take_ended(self, key: str) -> bool:
        """Whether a control ended private session ``key`` here before its marker was
        reached (forgotten now)."""
        if key in self._ended:
            self._ended.discard(key)
            return True
        return False

    def owned(self) -> dict[str, str]:
        return dict(self._owned)

    def owns(self, key: str) -> bool:
        return key in self._owned

    def empty(self) -> bool:
        return not self._slots and not self._owned and not any(self._recent.values())
