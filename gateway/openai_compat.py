"""``POST /v1/chat/completions``: any OpenAI client or bot library can talk to the agent.

The agent keeps each conversation's history itself, so only the **last user message** of
``messages`` is sent as the turn; earlier messages are ignored. The session is picked as:

1. header ``X-Session-Id``: one of the caller's chats (as in the JSON API), else 404;
2. otherwise the request's ``user`` field: one conversation per (caller, ``user``) —
   a bot passes its end user's id and each end user gets their own history;
3. neither (an empty ``user`` is none): one default conversation per caller.

A request may carry an ``Idempotency-Key`` header (as ``client_id`` in the JSON API): the
same key in the same conversation is the same message, run once; sent again (a retry
after a replica died under it) it is answered with the first answer.

Authentication is the gateway's (``Authorization: Bearer <token>``, i.e. the client's
``api_key``). ``model`` is echoed back; the deployment's workers decide the real model.
Streaming sends the worker's ``delta`` events as chunks (or the whole answer as one chunk
when the workers do not stream deltas).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from bus_redis import OutboundMessage
from gateway.api import CLIENT_ID, MAX_MESSAGE_CHARS, caller, gw
from gateway.app import Gateway, answers
from gateway.auth import User
from gateway.backlog import BacklogFullError, ChatGoneError, TooLargeError
from gateway.chats import Chat, ChatLimitError, end_user_digest
from gateway.hub import TooManyStreamsError

router = APIRouter(prefix="/v1")
ERROR_STATUS = {
    "provider_error": 502,
    "cancelled": 409,
    "too_large": 413,
    "busy": 429,
    "limit_exceeded": 429,
}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _text_parts(cls, value: Any) -> Any:
        """A ``text`` part's text is a string of UTF-8 (``null`` was asked as "None", an
        object as its repr, a lone surrogate a 500); parts of other types are ignored."""
        for part in value if isinstance(value, list) else ():
            if part.get("type") != "text":
                continue
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError("a text part's text must be a string")
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("a text part holds no UTF-8 (a lone surrogate)") from None
        return value


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str = Field("agent", max_length=256)  # (echoed in every chunk)
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    user: str | None = Field(None, max_length=256)


@router.get("/models")
async def models(user: Annotated[User, Depends(caller)]) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": "agent", "object": "model", "owned_by": "gateway"}]}


@router.post("/chat/completions", response_model=None)
async def completions(
    request: Request,
    body: CompletionRequest,
    user: Annotated[User, Depends(caller)],
    x_session_id: Annotated[str | None, Header()] = None,
    idempotency_key: Annotated[str | None, Header(pattern=CLIENT_ID)] = None,
) -> JSONResponse | StreamingResponse:
    g = gw(request)
    content = _last_user_text(body.messages)
    if content is None:  # (an older question is never asked again)
        return _error(
            400, "invalid_request_error", "the last message must be the user's, with text"
        )
    if len(content) > MAX_MESSAGE_CHARS:
        detail = (
            f"the last user message has {len(content)} characters (at most {MAX_MESSAGE_CHARS})"
        )
        return _error(413, "invalid_request_error", detail)
    chat = await _pick(g, user, x_session_id, body.user)
    if isinstance(chat, JSONResponse):
        return chat
    message_id = _message_id(chat, idempotency_key)
    cursor = await g.hub.last_id(g.keys.out(chat.session_key))
    if not g.has_room(user, chat):
        return _error(429, "rate_limit_exceeded", "too many open streams for this user")
    # a bot's end users: each a scope of its own (memory, session tools), counted as the
    # caller's own against the per-scope limits: the chat's, whichever route it comes by
    message = g.message(user, chat, content, id=message_id)
    try:
        ids = await g.publish(user, chat, message)
    except BacklogFullError as exc:
        return _error(429, "rate_limit_exceeded", str(exc))
    except ChatGoneError:
        return _error(404, "invalid_request_error", "no such session")
    except TooLargeError as exc:
        return _error(413, "invalid_request_error", str(exc))
    completion_id = f"chatcmpl-{message_id}"
    if body.stream:
        chunks = _stream(g, user, chat, ids, cursor, completion_id, body.model)
        return StreamingResponse(
            chunks, media_type="text/event-stream", headers={"X-Session-Id": chat.id}
        )
    try:
        ev = await g.wait_terminal(user, chat, ids, cursor, g.settings.wait_max_s)
    except TooManyStreamsError:
        return _error(429, "rate_limit_exceeded", "too many open streams for this user", sent=True)
    if ev is None:
        return _error(504, "timeout", "the agent did not answer in time", sent=True)
    if ev.type == "error":
        status = ERROR_STATUS.get(ev.code or "", 400)
        return _error(status, ev.code or "error", ev.content, sent=True)
    doc = {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.model,
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "message": {"role": "assistant", "content": ev.content},
            }
        ],
        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
    }
    return JSONResponse(doc, headers={"X-Session-Id": chat.id})


async def _pick(
    g: Gateway, user: User, session_id: str | None, end_user: str | None
) -> Chat | JSONResponse:
    """The conversation, or the error answer (OpenAI's shape, as every answer here)."""
    if session_id:
        chat = await g.chats.owned(user, session_id)
        if chat is None:
            return _error(404, "invalid_request_error", "no such session")
        return chat
    try:
        return await g.chats.ensure(user, f"{user.hash}-oa-{end_user_digest(end_user)}")
    except ChatLimitError as exc:  # (a retry meets the same limit: the SDK is told so)
        refused = _error(409, "invalid_request_error", str(exc))
        refused.headers["x-should-retry"] = "false"
        return refused


def _message_id(chat: Chat, idempotency_key: str | None) -> str:
    """A new id; with a key, the key's in this conversation: a request sent again (a
    replica died under it) is the same message, run once, its answer given again."""
    if not idempotency_key:
        return f"oa-{uuid.uuid4().hex}"
    digest = hashlib.sha256(f"{chat.session_key}|{idempotency_key}".encode()).hexdigest()
    return f"oa-{digest[:32]}"


def _last_user_text(messages: list[ChatMessage]) -> str | None:
    """The text of the last message when it is the user's (the agent keeps the history:
    only the newest message is new; a list ending with the assistant or a tool asks
    nothing, and an older user message must not be asked again)."""
    if not messages or messages[-1].role != "user":
        return None
    content = messages[-1].content
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # (text parts hold strings: ChatMessage)
        parts = [p["text"] for p in content if p.get("type") == "text"]
        return "\n".join(parts) if parts else None  # (an image alone asks nothing)
    return None


async def _stream(
    g: Gateway, user: User, chat: Chat, ids: set[str], cursor: str, completion_id: str, model: str
) -> AsyncIterator[bytes]:
    created = int(time.time())
    deadline = time.monotonic() + g.settings.wait_max_s

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        doc = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
        return f"data: {json.dumps(doc, ensure_ascii=False)}\n\n".encode()

    yield chunk({"role": "assistant", "content": ""})
    sent = ""  # what the client has (never taken back)
    attempt = _Attempt()
    try:
        async with contextlib.aclosing(_events(g, user, chat, ids, cursor, deadline)) as events:
            async for ev in events:
                if ev is None:
                    yield b": keep-alive\n\n"
                elif ev.type in ("delta", "progress"):
                    piece = attempt.add(ev, sent)
                    if piece:
                        sent += piece
                        yield chunk({"content": piece})
                elif ev.type == "message":
                    rest = ev.content[len(sent) :] if ev.content.startswith(sent) else ev.content
                    if rest:
                        yield chunk({"content": rest})
                    yield chunk({}, "stop")
                    break
                elif ev.type == "error":
                    err = {"error": {"message": ev.content, "type": ev.code, "code": ev.code}}
                    yield f"data: {json.dumps(err)}\n\n".encode()
                    break
    except TimeoutError:
        err = {"error": {"message": "the agent did not answer in time", "type": "timeout"}}
        yield f"data: {json.dumps(err)}\n\n".encode()
    except TooManyStreamsError:
        err = {"error": {"message": "too many open streams", "type": "rate_limit_exceeded"}}
        yield f"data: {json.dumps(err)}\n\n".encode()
    yield b"data: [DONE]\n\n"


class _Attempt:
    """The text of the answer's current attempt, from its deltas. A worker lost mid-answer
    leaves it to another, whose events number from 1 again (``seq``): its deltas are
    taken from there, and only what goes past what the client already has is sent (the
    same answer goes on where it stopped; one that differs is not sent in pieces: the
    final message brings it whole). An attempt followed from its middle (a request sent
    again with its ``Idempotency-Key`` while the first answer is being written; an event
    missing) has lost its beginning: none of it is sent in pieces either."""

    __slots__ = ("last_seq", "text", "whole")

    def __init__(self) -> None:
        self.text = ""
        self.last_seq = 0
        self.whole = True  # every event of the attempt seen so far

    def add(self, ev: OutboundMessage, sent: str) -> str:
        """What of ``ev`` (a delta or a progress event) to send after ``sent``."""
        seq = ev.metadata.get("seq")
        if isinstance(seq, int) and not isinstance(seq, bool):
            if seq <= self.last_seq:  # numbered from 1 again: another attempt
                self.text, self.whole = "", seq == 1
            elif seq != self.last_seq + 1:  # events before this one were not seen
                self.whole = False
            self.last_seq = seq
        if ev.type != "delta" or not ev.content:
            return ""
        self.text += ev.content
        if not self.whole:
            return ""
        if len(self.text) > len(sent) and self.text.startswith(sent):
            return self.text[len(sent) :]
        return ""


async def _events(
    g: Gateway, user: User, chat: Chat, ids: set[str], cursor: str, deadline: float
) -> AsyncGenerator[OutboundMessage | None, None]:
    """The events answering ``ids`` (None: a keep-alive tick) until ``deadline``."""
    async with g.subscribe(user, chat, cursor) as sub:
        async for item in sub.events(g.settings.keepalive_s):
            if time.monotonic() > deadline:
                raise TimeoutError
            if item is None:
                yield None
            elif item.event is not None and answers(item.event, ids):
                yield item.event


def _error(status: int, kind: str, message: str, *, sent: bool = False) -> JSONResponse:
    """An OpenAI-style error; ``sent``: the message was queued already, so a client must
    not send it again (the openai SDK retries 408/409/429/5xx unless told not to: each
    retry would be a new message, its question run again)."""
    headers = {"x-should-retry": "false"} if sent else None
    body = {"error": {"message": message, "type": kind, "code": kind}}
    return JSONResponse(body, status, headers=headers)
