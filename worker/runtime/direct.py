"""One message answered in process (``AgentLoop.process_message``, README: Embedding):
under the session's Redis lease, committed like any turn, the reply returned to the
caller instead of published, as the reference loop's ``_process_message`` does."""

from __future__ import annotations

import time
import weakref
from time import monotonic

from bus_redis import SESSION_NOT_ACTIVE, InboundMessage, OutboundMessage, RedisBus
from bus_redis.codec import safe, server_ms
from bus_redis.results import CommitSpec
from worker.runtime.acquiring import Acquirer
from worker.runtime.context import Runtime
from worker.runtime.holder import SessionHolder
from worker.runtime.outcomes import SessionNotActiveError

MAX_SEQ = 2**64 - 1  # a stream id's largest sequence number
OFFSET_KEPT_S = 30.0  # how long a measure of Redis's clock against this host's is used
# bus -> (Redis's clock less this host's, ms; when measured, monotonic s)
_OFFSETS: weakref.WeakKeyDictionary[RedisBus, tuple[float, float]] = weakref.WeakKeyDictionary()


async def redis_now_ms(bus: RedisBus) -> int:
    """Redis's clock now, ms, by this host's and an offset measured (one ``TIME``) at
    most ``OFFSET_KEPT_S`` ago: stream ids are Redis's, and a host whose clock is ahead
    took every control of a turn's first moments for one before it."""
    known = _OFFSETS.get(bus)
    if known is None or monotonic() - known[1] > OFFSET_KEPT_S:
        before = time.time() * 1000
        server = await server_ms(bus.redis)
        after = time.time() * 1000
        known = _OFFSETS[bus] = (server - (before + after) / 2, monotonic())
    return int(time.time() * 1000 + known[0])


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
    # only controls published from now on: any marker of this millisecond of Redis's
    # clock or later (one of this very millisecond, T-0, was taken for one before the turn
    # and the control lost: a second reading's test failed under load, stop 52; by this
    # host's clock, every control of the skew's length was)
    now_id = f"{await redis_now_ms(rt.bus) - 1}-{MAX_SEQ}"
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
