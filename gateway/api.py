"""The JSON API and the SSE event stream (OpenAPI at ``/docs`` and ``/openapi.json``).

Every route that takes a chat id answers 404 unless the caller owns it, exactly as for a
chat that does not exist, so one user cannot even learn another's ids.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, HTTPException, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator
from sse_starlette import EventSourceResponse, ServerSentEvent

from bus_redis import OutboundMessage, SessionBusyError
from bus_redis.schema import MAX_DEPTH, FollowUp
from gateway.app import Gateway
from gateway.auth import User
from gateway.backlog import BacklogFullError, ChatGoneError, TooLargeError
from gateway.chats import Chat, ChatLimitError
from gateway.hub import TooManyStreamsError

MAX_MESSAGE_CHARS = 100_000  # a message's text (here and on the OpenAI endpoint)
router = APIRouter(prefix="/api")
CURSOR_RE = re.compile(r"\$|0|[0-9]{1,20}-[0-9]{1,20}")
MAX_ID_PART = 2**64 - 1


def valid_cursor(cursor: str) -> bool:
    """``$``, ``0`` or a stream entry id whose parts fit Redis' 64-bit integers."""
    if not CURSOR_RE.fullmatch(cursor):
        return False
    return cursor in ("$", "0") or all(int(p) <= MAX_ID_PART for p in cursor.split("-"))


CLIENT_ID = r"^[A-Za-z0-9_.:-]{1,128}$"


def gw(request: Request) -> Gateway:
    return request.app.state.gw


@asynccontextmanager
async def refusals() -> AsyncIterator[None]:
    """A write the gateway refused, as HTTP: nothing was written."""
    try:
        yield
    except BacklogFullError as exc:
        raise HTTPException(429, str(exc)) from None
    except ChatGoneError:  # deleted meanwhile: as for any chat that is not the caller's
        raise HTTPException(404, "no such session") from None
    except TooLargeError as exc:
        raise HTTPException(413, str(exc)) from None
    except SessionBusyError as exc:
        raise HTTPException(409, str(exc)) from None


async def caller(request: Request) -> User:
    return await gw(request).auth.user(request)


async def stream_caller(request: Request) -> User:
    """EventSource cannot send headers: a ticket in the URL is accepted here."""
    return await gw(request).auth.user(request, ticket_ok=True)


Caller = Annotated[User, Depends(caller)]


async def owned(request: Request, session_id: str, user: Caller) -> Chat:
    chat = await gw(request).chats.owned(user, session_id)
    if chat is None:
        raise HTTPException(404, "no such session")
    return chat


Owned = Annotated[Chat, Depends(owned)]


# --- bodies -----------------------------------------------------------------------------
class NewSession(BaseModel):
    model_config = ConfigDict(extra="ignore")
    temporary: bool = Field(False, description="a private session: not stored, fewer tools")
    title: str = Field("", max_length=200)


class NewMessage(BaseModel):
    """Anything else in the body (scope, session_key_override, require_existing_session,
    a channel...) is ignored: the gateway decides those."""

    model_config = ConfigDict(extra="ignore")
    content: str = Field(max_length=MAX_MESSAGE_CHARS)
    client_id: str | None = Field(
        None, pattern=CLIENT_ID, description="re-posting the same id never runs a second turn"
    )
    metadata: dict[str, Any] = Field(
        default_factory=dict, description="given to tools; keys starting with '_' are dropped"
    )
    followup: FollowUp | None = Field(
        None,
        description="while the chat is answering: inject (join the turn), queue, interrupt "
        "(cancel it and start again with everything pending) or reject (409 busy); "
        "default AGENT_GATEWAY_FOLLOWUP, else the workers' AGENT_FOLLOWUP_MODE",
    )

    @field_validator("metadata")
    @classmethod
    def _shallow(cls, value: dict[str, Any]) -> dict[str, Any]:
        """As deep as the workers take a payload (``MAX_DEPTH``, the message around it
        counted): deeper was queued and refused by the worker, or, past what pydantic
        writes, a 500."""
        if _nesting(value, MAX_DEPTH) >= MAX_DEPTH:
            raise ValueError(f"metadata nests deeper than {MAX_DEPTH - 1} levels")
        return value


def _nesting(value: Any, cap: int) -> int:
    """How deep ``value`` nests (objects and arrays), counted up to ``cap``, without
    recursion. A string (a value or a key) that is no UTF-8 (a lone surrogate: valid
    JSON) raises ValueError: the message could not be written (a 500 before)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, str):
            _utf8(item)
        elif isinstance(item, dict):
            for key in item:
                _utf8(key)
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            if deepest >= cap:
                return deepest
            todo.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def _utf8(value: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("metadata holds a string that is no UTF-8 (a lone surrogate)") from None


class Accepted(BaseModel):
    session_id: str
    message_id: str
    cursor: str = Field(description="the last event id before this message: read events after it")
    event: dict[str, Any] | None = Field(None, description="the terminal event (with ?wait=)")


# --- routes -----------------------------------------------------------------------------
@router.get("/me")
async def me(user: Caller) -> dict[str, str]:
    return {"user": user.id}


@router.post("/tickets", status_code=201)
async def ticket(request: Request, user: Caller) -> dict[str, Any]:
    """A short-lived ticket for ``EventSource`` and WebSocket URLs (``?ticket=``)."""
    g = gw(request)
    return {"ticket": await g.auth.mint_ticket(user), "expires_in_s": g.settings.ticket_ttl_s}


@router.get("/sessions")
async def list_sessions(request: Request, user: Caller) -> list[dict[str, Any]]:
    """The caller's durable chats, newest first (temporary chats are never listed)."""
    return [c.public() for c in await gw(request).chats.list_for(user)]


@router.post("/sessions", status_code=201)
async def create_session(request: Request, user: Caller, body: NewSession) -> dict[str, Any]:
    g = gw(request)
    if not body.temporary:  # nothing is sent to the workers
        try:
            created = await g.chats.create(user, title=body.title)
        except ChatLimitError as exc:
            raise HTTPException(409, str(exc)) from None
        return await g.chats.status(created)
    async with refusals():
        chat = await g.open_temporary(user)
    return await g.chats.status(chat)


@router.get("/sessions/{session_id}")
async def get_session(request: Request, chat: Owned) -> dict[str, Any]:
    return await gw(request).chats.status(chat)


@router.get("/sessions/{session_id}/messages")
async def history(
    request: Request,
    response: Response,
    chat: Owned,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 200,
) -> list[dict[str, Any]]:
    """The newest stored rows. Header ``X-Event-Cursor``: the chat's events stream as of
    these rows (read with them at once): follow the events after it, and no answer is
    both in the rows and among the events (a turn ends with its rows and its event)."""
    g = gw(request)
    rows, cursor = await g.chats.history(chat, min(limit, g.settings.history_limit))
    response.headers["X-Event-Cursor"] = cursor
    return rows


@router.delete("/sessions/{session_id}", status_code=204)
async def delete_session(request: Request, user: Caller, chat: Owned) -> Response:
    """A durable chat: its stored history and events are deleted (a running turn is
    cancelled first); a temporary chat is discarded."""
    g = gw(request)
    async with refusals():
        await g.control(user, chat, "discard" if chat.temporary else "delete", forget=True)
    return Response(status_code=204)


@router.post("/sessions/{session_id}/messages", status_code=202, response_model=Accepted)
async def send(
    request: Request,
    response: Response,
    user: Caller,
    chat: Owned,
    body: NewMessage,
    wait: Annotated[float, Query(ge=0, description="seconds to wait for the terminal event")] = 0,
) -> Accepted:
    g = gw(request)
    if wait > 0 and not g.has_room(user, chat):  # refused before anything is sent
        raise HTTPException(429, "too many open streams to wait; send without ?wait=")
    message_id = body.client_id or uuid.uuid4().hex
    cursor = await g.hub.last_id(g.keys.out(chat.session_key))
    msg = g.message(
        user, chat, body.content, id=message_id, metadata=body.metadata, followup=body.followup
    )
    async with refusals():
        ids = await g.publish(user, chat, msg)
    accepted = Accepted(session_id=chat.id, message_id=message_id, cursor=cursor)
    if wait > 0:
        timeout_s = min(wait, g.settings.wait_max_s)
        try:
            event = await g.wait_terminal(user, chat, ids, cursor, timeout_s)
        except TooManyStreamsError:  # sent: answered as a wait that ran out (202), never
            return accepted  # 429, which says nothing was sent
        if event is not None:
            response.status_code = 200
            accepted.event = public_event(chat, event)
    return accepted


@router.post("/sessions/{session_id}/stop", status_code=202)
async def stop(request: Request, user: Caller, chat: Owned) -> dict[str, str]:
    """Cancel the running turn and the messages queued before this call."""
    async with refusals():
        await gw(request).control(user, chat, "stop")
    return {"session_id": chat.id, "op": "stop"}


@router.post("/sessions/{session_id}/discard", status_code=202)
async def discard(request: Request, user: Caller, chat: Owned) -> dict[str, str]:
    """Stop, and end a temporary chat for good (a durable chat keeps its history)."""
    g = gw(request)
    async with refusals():
        await g.control(user, chat, "discard", forget=chat.temporary)
    return {"session_id": chat.id, "op": "discard"}


@router.post("/sessions/{session_id}/new", status_code=202)
async def new_conversation(request: Request, user: Caller, chat: Owned) -> dict[str, str]:
    """A fresh conversation in the same chat (nanobot's ``/new``): the history so far is
    summarised into the user's long-term memory, then cleared; messages sent before this
    call are cancelled. A temporary chat is discarded."""
    g = gw(request)
    op = "discard" if chat.temporary else "new"
    async with refusals():
        await g.control(user, chat, op, forget=chat.temporary)
    return {"session_id": chat.id, "op": op}


@router.get(
    "/sessions/{session_id}/events",
    response_class=EventSourceResponse,
    responses={200: {"content": {"text/event-stream": {}}}},
)
async def events(
    request: Request,
    session_id: str,
    user: Annotated[User, Depends(stream_caller)],
    after: Annotated[str | None, Query(description="resume after this event id")] = None,
    last_event_id: Annotated[str | None, Header()] = None,
) -> EventSourceResponse:
    """Server-sent events of one chat: ``message``, ``delta``, ``progress``, ``error`` and
    ``gap``; ``id:`` is the event's entry id (resume with ``Last-Event-ID`` or ``?after=``
    on any replica). Closing the stream cancels nothing."""
    g = gw(request)
    chat = await g.chats.owned(user, session_id)
    if chat is None:
        raise HTTPException(404, "no such session")
    cursor = last_event_id or after or "$"
    if not valid_cursor(cursor):
        raise HTTPException(400, "a cursor is an event id like 1700000000000-0, 0 or $")
    if not g.has_room(user, chat):
        raise HTTPException(429, "too many open event streams; close one or retry later")

    async def stream() -> AsyncIterator[ServerSentEvent]:
        yield ServerSentEvent(comment="stream open", retry=g.settings.sse_retry_ms)
        try:
            async with g.subscribe(user, chat, cursor) as sub:
                async for ev in sub.events(g.settings.keepalive_s):
                    if ev is None:
                        yield ServerSentEvent(comment="keep-alive")
                    elif ev.kind == "gap":
                        yield ServerSentEvent(
                            _json({"after": ev.entry_id}), event="gap", id=ev.entry_id
                        )
                    elif ev.event is not None:
                        data = public_event(chat, ev.event)
                        yield ServerSentEvent(_json(data), event=ev.event.type, id=ev.entry_id)
        except TooManyStreamsError:  # filled up meanwhile: the client retries
            yield ServerSentEvent(comment="too many open streams, retry later")

    return EventSourceResponse(
        stream(), ping=3600, send_timeout=30, headers={"Cache-Control": "no-store"}
    )


def public_event(chat: Chat, ev: OutboundMessage) -> dict[str, Any]:
    """What a client sees of an event: its chat id, never the internal session key."""
    return {
        "id": ev.entry_id,
        "session_id": chat.id,
        "type": ev.type,
        "reply_to": ev.reply_to,
        "content": ev.content,
        "code": ev.code,
        "covers": ev.covers,
        "metadata": ev.metadata,
    }


def _json(doc: Any) -> str:
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":"))
