"""One message answered in process (``AgentLoop.process_message``, README: Embedding):
under the session's Redis lease, committed like any turn, the reply returned to the
caller instead of published, as the reference loop's ``_process_message`` does."""

from __future__ import annotations

import time

from bus_redis import SESSION_NOT_ACTIVE, InboundMessage, OutboundMessage
from bus_redis.codec import safe
from bus_redis.results import CommitSpec
from worker.runtime.acquiring import Acquirer
from worker.runtime.context import Runtime
from worker.runtime.holder import SessionHolder
from worker.runtime.outcomes import SessionNotActiveError

MAX_SEQ = 2**64 - 1  # a stream id's largest sequence number


async def process_message(
    rt: Runtime, acquirer: Acquirer, msg: InboundMessage
) -> OutboundMessage | None:
    """Run one turn for ``msg`` under the session's Redis lease and commit it.

    Raises ``RuntimeError("required session is not active")`` when the message
    requires a live session this worker does not hold.
    """
    key = acquirer.effective_key(msg.session_key)
    if msg.require_existing_session and not rt.sessions.is_transient(key):
        raise SessionNotActiveError(SESSION_NOT_ACTIVE)
    acquired, scope = await acquirer.acquire_blocking(key)
    holder = SessionHolder(rt, key, acquired, set(), scope)
    holder.lease.start()
    # only controls published from now on: any marker of this millisecond or later (one
    # of this very millisecond, T-0, was taken for one before the turn and the control
    # lost: a second reading's test failed under load, stop 52)
    now_id = f"{int(time.time() * 1000) - 1}-{MAX_SEQ}"
    holder.slot = rt.turns.begin(key, msg.session_key, now_id)
    try:
        outcome = await holder.run_message(msg, reply_to=msg.id or "", member=msg.session_key)
        spec = CommitSpec(member=msg.session_key, transient=holder.transient)
        holder.fill_spec(spec, outcome)
        spec.reply = ""  # returned to the caller
        await holder.commit_full(f"commit of {safe(key)}", spec, select=None)
        return outcome.reply
    finally:
        rt.turns.end(key, holder.slot)
        await holder.lease.stop()
        if not holder.lease.lost:
            await rt.bus.release(key, acquired.token)
