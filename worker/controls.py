"""Controls: what a worker does with a stop or discard that reached it over pub/sub.

The pub/sub message only says "look": a turn is cancelled once a marker is confirmed
queued after the entry it runs (so a late message of an earlier control never cancels a
newer turn), and a control that finds no entry being handled is remembered briefly for an
entry that may be between its selection and its registration.
"""

from __future__ import annotations

from bus_redis import ControlMessage
from worker.runtime import Runtime

FORGETTING = ("discard", "delete")  # ops that make a worker forget the session


class Controls:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    def on_control(self, control: ControlMessage) -> None:
        """A stop / discard / delete for session S (called by the control subscription)."""
        rt, target = self.rt, control.session_key
        running = {k: v for k, v in rt.turns.running().items() if target in (k, v[0])}
        if running:
            rt.spawn(self.confirm_and_cancel(running))
        else:
            rt.turns.note_control(target)  # an entry may be between select and begin
        if control.op in FORGETTING and not rt.sessions.is_transient(target):
            rt.sessions.invalidate(target)
        # A private session is forgotten (and its owner record dropped) when its holder
        # reaches the discard marker: exactly in stream order, under its lease.

    async def confirm_and_cancel(self, running: dict[str, tuple[str, str]]) -> None:
        """Cancel the running entries that a queued marker covers; a discard also forgets
        the session at once (exact: the marker follows the entry this worker runs under
        the lease, so no other worker serves the session meanwhile)."""
        rt = self.rt
        markers = await rt.registry.markers_after(running)
        for key, op in markers.items():
            member, entry_id = running[key]
            if rt.turns.cancel_entry(key, entry_id, op) and op in FORGETTING:
                owned = rt.turns.disown(member)
                rt.sessions.invalidate(member)
                if owned is not None:
                    await rt.registry.drop_owner(member, rt.worker_id, owned)

    async def check_missed(self) -> None:
        """After (re)subscribing: apply controls published while we were not listening."""
        await self.confirm_and_cancel(self.rt.turns.running())
