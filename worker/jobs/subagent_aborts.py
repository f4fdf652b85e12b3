"""Aborting a session's subagents (``Subagents.aborts``): a stop, discard, delete or
``new`` of the session published after the spawning message ends them. Every worker hears
the control over pub/sub (its marker id says where it stands in the session's stream),
cancels the ones it runs (they unregister themselves) and remembers it, so a job of that
session starting or finishing later here drops itself (``stopped_after``); the worker
that spawned them also unregisters those not started yet (one task for all controls: a
flood of controls for a session costs one look, not a task each, and the channels take
turns, so one channel's flood of stops holds back no other's; a look Redis failed is
tried again, ``ABORT_TRIES`` times in about 3 s).

Memory is bounded per channel: the sessions spawned for here and the latest aborting
control heard of each are LRUs of ``SPAWNED_HERE_MAX`` per channel, so one channel's flood
forgets none of another's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from redis.exceptions import RedisError

from bus_redis import ControlMessage
from bus_redis.codec import parse_stream_id, safe
from bus_redis.keys import channel_of
from bus_redis.subagents import SubagentStore
from worker.runtime.context import Runtime

log = logging.getLogger(__name__)
ABORTING = ("stop", "discard", "delete", "new")
SPAWNED_HERE_MAX = 10_000  # sessions this worker remembers having spawned for, per channel
ABORT_TRIES = 5  # looks at a session's registrations while Redis fails them (~3 s in all)

Running = dict[str, dict[str, tuple["asyncio.Task[str]", dict[str, Any]]]]


class Aborts:
    def __init__(
        self, rt: Runtime, store: SubagentStore, running: Running, aborted: set[str]
    ) -> None:
        self.rt = rt
        self.store = store
        self.running = running  # Subagents': session -> id -> (task, what it does)
        self.aborted = aborted  # Subagents': ids cancelled by a control (not by shutdown)
        # channel -> sessions with subagents spawned here
        self.spawned_here: dict[str, dict[str, None]] = {}
        # channel -> session -> its latest aborting control heard
        self.stopped: dict[str, dict[str, tuple[int, int]]] = {}
        # channel -> sessions whose registrations a control ends, looked at by one task,
        # the channels in turn (one channel's flood holds back no other's stop), bounded
        # by spawned_here
        self._to_abort: dict[str, dict[str, tuple[int, int]]] = {}
        self._aborting = False
        self._failed: dict[str, int] = {}  # session -> looks Redis failed in a row

    def remember(self, session: str) -> None:
        """This worker spawned a subagent for ``session``."""
        _lru(self.spawned_here.setdefault(channel_of(session), {}), session, None)

    def stopped_after(self, spec: dict[str, Any]) -> bool:
        """Whether this worker heard an aborting control of the session after the
        message that spawned ``spec``."""
        session = str(spec["session"])
        heard = self.stopped.get(channel_of(session), {}).get(session)
        return heard is not None and heard > parse_stream_id(str(spec.get("after") or "0-0"))

    def on_control(self, control: ControlMessage) -> None:
        """A stop, discard, delete or new of a session: its subagents spawned before the
        control end (here at once), and are remembered as ended for jobs to come."""
        if control.op not in ABORTING:
            return
        session = control.session_key
        # without a marker id, the control is taken as published now (this worker's clock)
        at = parse_stream_id(control.marker or f"{int(time.time() * 1000)}-0")
        heard = self.stopped.setdefault(channel_of(session), {})  # (served channels only)
        _lru(heard, session, max(at, heard.get(session, (0, 0))))
        for sid, (task, spec) in self.running.get(session, {}).items():
            if self.stopped_after(spec):
                self.aborted.add(sid)
                task.cancel()
        if session in self.spawned_here.get(channel_of(session), {}):  # the ones not started yet
            self._queue(session, at)

    def _queue(self, session: str, at: tuple[int, int]) -> None:
        queued = self._to_abort.setdefault(channel_of(session), {})
        queued[session] = max(at, queued.get(session, (0, 0)))
        if not self._aborting:
            self._aborting = True
            self.rt.spawn(self._abort_all())

    async def _abort_all(self) -> None:
        try:
            while self._to_abort:
                for channel in list(self._to_abort):  # one session of each channel in turn
                    queued = self._to_abort[channel]
                    session = next(iter(queued))
                    at = queued.pop(session)
                    if not queued:
                        del self._to_abort[channel]
                    try:
                        await self._abort(session, at)
                        self._failed.pop(session, None)
                    except RedisError as exc:
                        self._again(session, at, exc)
        finally:
            self._aborting = False

    def _again(self, session: str, at: tuple[int, int], exc: RedisError) -> None:
        """A look Redis failed (a blip): queued again a moment later, the others going on
        meanwhile; given up after ``ABORT_TRIES``."""
        tries = self._failed[session] = self._failed.get(session, 0) + 1
        if tries >= ABORT_TRIES:
            self._failed.pop(session)
            log.warning("subagents of %s not unregistered: %s", safe(session),
                        type(exc).__name__)  # fmt: skip
            return
        asyncio.get_running_loop().call_later(0.1 * 2**tries, self._queue, session, at)

    async def _abort(self, session: str, at: tuple[int, int]) -> None:
        """Unregister the session's subagents spawned before the control at ``at``."""
        for sid, raw in (await self.store.of_session(session)).items():
            try:
                after = parse_stream_id(str(json.loads(raw).get("after") or "0-0"))
            except (ValueError, AttributeError):
                after = (0, 0)
            if after < at:
                await self.store.drop(session, sid)


def _lru(table: dict[Any, Any], key: Any, value: Any) -> None:
    table.pop(key, None)
    table[key] = value
    while len(table) > SPAWNED_HERE_MAX:
        table.pop(next(iter(table)))
