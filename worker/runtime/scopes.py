"""Scopes: which messages a session takes. A session belongs to one scope, fixed by its
first message (whose entry id it keeps: ``born``); a user message of another scope is
refused, and so is a worker-made one (a firing, a subagent's result) for a conversation
that is gone. Used by the turn (``execution``) and by an interrupt before it cuts a turn
(``interrupts``)."""

from __future__ import annotations

from bus_redis import InboundMessage
from bus_redis.codec import parse_stream_id
from session_store import Session
from worker.runtime.context import Runtime
from worker.runtime.outcomes import ScopeMismatchError, SessionNotActiveError


def foreign(rt: Runtime, msg: InboundMessage, scope: str) -> bool:
    """Whether ``msg`` is a user message of another scope than ``scope``, a session's (one
    with no scope yet takes any)."""
    if not scope or not msg.is_user_input or rt.config.owner_mode:
        return False
    return rt.scope_for(msg.channel, msg.scope, msg.sender_id) != scope


def check_scope(rt: Runtime, msg: InboundMessage, session: Session, entry_id: str) -> None:
    """Raise when ``session`` must not take ``msg``; the first message fixes its scope
    (and its quota's owner)."""
    # a firing or a subagent's result for a conversation never stored (the turn that
    # made it was not committed) or deleted since: it must not start one, under a
    # scope of its own that other sessions would share, nor run in a conversation
    # started under the key since (queued behind the delete or new that ended its
    # own), maybe another user's
    older = _older(msg.metadata.get("from"), session.born)
    if msg.worker_made and (
        (not rt.config.owner_mode and (not session.scope or older))
        or (older and not session.policy.persist)  # (a private one opened on its key)
    ):
        raise SessionNotActiveError("the conversation this message was for is gone")
    if not session.scope:
        session.scope = rt.scope_for(msg.channel, msg.scope, msg.sender_id)
        session.born = entry_id
        if msg.quota and not rt.config.owner_mode:  # (in the scopes' namespace)
            session.quota = rt.scope_for(msg.channel, msg.quota, msg.sender_id)
    elif foreign(rt, msg, session.scope):
        raise ScopeMismatchError(
            "the message's scope does not match its session's scope (a frontend must "
            "vouch the same scope for every sender of a shared session)"
        )


def _older(origin: object, born: str) -> bool:
    """Whether a worker-made message made by the turn of entry ``origin`` is older than
    the conversation started by entry ``born`` (both of the session's own stream; either
    unknown: not older)."""
    if not isinstance(origin, str) or not origin or not born:
        return False
    return parse_stream_id(origin) < parse_stream_id(born)
