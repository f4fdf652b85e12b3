"""The gateway attacked a sixth time, as a hostile user behind a valid token. Each test
fails on the code it was written against for the reason its docstring gives.

- ``?wait=`` given twice: ``Deadline`` lifts the deadline when *any* value is over 0,
  the route takes the *last* one. ``?wait=5&wait=0`` is a send that does not wait, with
  no deadline: a Redis that stops answering holds it for ever (no 503).
- A lone surrogate in a ``metadata`` value (valid JSON, no UTF-8) is a 500, not a 422.
- The OpenAI-compatible endpoint takes a content part's ``text`` whatever its type:
  ``null`` is sent to the agent as the question ``"None"``, an object as its Python
  ``repr``; a lone surrogate in it is a 500; a last user message with no text part at all
  is sent as an empty question (the route's own 400 is "the last message must be the
  user's, with text").
- A WebSocket frame naming a lone surrogate as its ``session_id`` is echoed in the error
  frame; encoding it fails in the socket's writer task, which dies: the socket answers
  nothing any more, and is not closed.
- A WebSocket subscription with ``"after": 0`` (a JSON number: the cursor "everything
  kept", as ``?after=0``) is silently taken as ``$``: every event already written is
  skipped, while the client is told it is subscribed.

In process (httpx over ASGI) on both backends (``redis_factory``) where no worker is
needed; a real gateway process for the WebSockets. No sleeps synchronize
anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient
from test_gateway_api import ALICE, TOKENS, frozen_gateway

from bus_redis import OutboundMessage
from bus_redis.keys import Keys
from gateway.app import Gateway, create_app
from gateway.auth import User
from gateway.settings import GatewaySettings

pytestmark = pytest.mark.frontend
K = Keys()
JSON_ALICE = {**ALICE, "content-type": "application/json"}
TOKENS_ENV = ",".join(f"{t}={u}" for t, u in TOKENS.items())


async def _queued(redis: Any, chat_id: str) -> list[Any]:
    """The contents of what was sent to the workers for the chat."""
    entries = await redis.xrange(K.inbound(f"web:{chat_id}"))
    return [json.loads(fields["payload"]).get("content") for _id, fields in entries]


@contextlib.asynccontextmanager
async def _client(make: Any, **settings: Any) -> AsyncIterator[httpx.AsyncClient]:
    """The gateway's app in process over ``make``'s server; its event readers block for
    0.1 s at most, so the app's end does not wait out a 5 s read."""
    config = GatewaySettings(**{"tokens": TOKENS, **settings})
    gw = Gateway(config, make(), [make()])
    gw.hub.block_ms = 100
    app = create_app(config, gw)
    gw.hub.start()
    app.state.gw = gw
    transport = httpx.ASGITransport(
        app=app, client=("127.0.0.1", 40000), raise_app_exceptions=False
    )  # (an unhandled error is the 500 a client gets)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            yield http
    finally:
        await gw.hub.stop()


def _oa_chat() -> str:
    """The OpenAI endpoint's default chat of alice (no ``user`` field)."""
    from gateway.chats import end_user_digest

    return f"{User('alice').hash}-oa-{end_user_digest(None)}"


# --- 1. ?wait= given twice ---------------------------------------------------------------------


async def test_a_send_with_wait_given_twice_keeps_its_deadline() -> None:
    """``Deadline.waits`` exempts a send when any ``wait`` value is over 0; FastAPI gives
    the route the last one. ``POST .../messages?wait=5&wait=0`` is a send that does not
    wait (answered 202 at once on a Redis that answers), yet has no deadline: against a
    Redis that stopped answering it is held for ever instead of the documented 503 at
    AGENT_GATEWAY_REQUEST_TIMEOUT_S. Fix: decide from the value the route will use (the
    last), or the route itself applies the deadline up to the wait."""
    chat_id = f"{User('alice').hash}-{'0' * 24}"
    async with frozen_gateway() as http:
        send = http.post(
            f"/api/sessions/{chat_id}/messages?wait=5&wait=0",
            json={"content": "hi"},
            headers=ALICE,
        )
        try:  # (a failure guard only: the 503 is due at 0.3 s)
            r = await asyncio.wait_for(send, 3)
        except TimeoutError:
            pytest.fail("a send with ?wait=5&wait=0 unanswered 3 s past a 0.3 s deadline")
        assert r.status_code == 503


# --- 2. lone surrogates --------------------------------------------------------------------------


async def test_a_lone_surrogate_in_metadata_is_refused_as_invalid_not_a_500(
    redis_factory: Any,
) -> None:
    """A lone surrogate is valid JSON and no UTF-8; in ``content`` or a title it is a
    422 (test_gateway_api), but ``metadata`` is ``dict[str, Any]``: the value passes
    validation and the send fails later (500, an unhandled error). Fix: refuse strings
    with lone surrogates in ``NewMessage._shallow`` (or replace them, as the workers'
    schema does)."""
    async with _client(redis_factory) as http:
        sid = (await http.post("/api/sessions", json={}, headers=ALICE)).json()["id"]
        body = b'{"content": "hi", "metadata": {"k": "PRIVATE \\ud800"}}'
        r = await http.post(f"/api/sessions/{sid}/messages", content=body, headers=JSON_ALICE)
        # 422 as for ``content``; or taken with the half replaced (as the workers do)
        assert r.status_code in (202, 422), f"HTTP {r.status_code}: {r.text[:200]}"
        assert "PRIVATE" not in r.text


async def test_a_lone_surrogate_in_an_openai_text_part_is_refused_not_a_500(
    redis_factory: Any,
) -> None:
    """The OpenAI endpoint's content parts are ``dict[str, Any]``: a ``text`` with a lone
    surrogate passes validation and fails when the message is built (500). A ``content``
    string with one is a 422. Fix: validate the parts (``{"type": "text", "text": str}``)
    in ``ChatMessage``."""
    async with _client(redis_factory, wait_max_s=0.2) as http:
        body = b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}'
        r = await http.post("/v1/chat/completions", content=body, headers=JSON_ALICE)
        # 400/422 as for a ``content`` string; or sent with the half replaced (then the
        # answer that does not come in 0.2 s: 504)
        assert r.status_code in (400, 422, 504), f"HTTP {r.status_code}: {r.text[:200]}"


# --- 3. OpenAI content parts ----------------------------------------------------------------------


@pytest.mark.parametrize("text", [None, {"a": 1}, ["x"]], ids=["null", "object", "array"])
async def test_an_openai_text_part_that_is_no_string_is_refused_not_sent_as_its_repr(
    redis_factory: Any, text: Any
) -> None:
    """``_last_user_text`` joins ``str(p.get("text", ""))``: a part ``{"type": "text",
    "text": null}`` is sent to the agent as the question "None", an object as its Python
    repr ("{'a': 1}"), and the client is answered as if it had asked that. OpenAI answers
    such a request 400; here it should be 400/422 with nothing queued. Fix: a typed
    content part model (``text: str``) in ``ChatMessage``."""
    async with _client(redis_factory, wait_max_s=0.2) as http:
        content = [{"type": "text", "text": text}]
        body = {"messages": [{"role": "user", "content": content}]}
        r = await http.post("/v1/chat/completions", json=body, headers=ALICE)
        queued = await _queued(redis_factory(), _oa_chat())
        assert queued == [], f"HTTP {r.status_code}; sent to the agent: {queued}"
        assert r.status_code in (400, 422), r.text


async def test_an_openai_user_message_without_any_text_is_refused_not_sent_empty(
    redis_factory: Any,
) -> None:
    """A last user message whose parts hold no text (an image only: the gateway passes
    no images on) is sent to the agent as an empty question, and the client gets the
    answer to that. The route refuses a last message without text itself (400 "the last
    message must be the user's, with text") when ``content`` is null; a list of parts
    without a text part is no different. Fix: ``_last_user_text`` returns None when no
    part is a text part."""
    async with _client(redis_factory, wait_max_s=0.2) as http:
        content = [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]
        body = {"messages": [{"role": "user", "content": content}]}
        r = await http.post("/v1/chat/completions", json=body, headers=ALICE)
        queued = await _queued(redis_factory(), _oa_chat())
        assert queued == [], f"HTTP {r.status_code}; sent to the agent: {queued}"
        assert r.status_code == 400, r.text


# --- 4. WebSocket cursors -------------------------------------------------------------------------


def _add_event(admin: Any, chat_id: str, content: str) -> str:
    """An event of a chat as a worker adds it: to its stream, its name to the pulse."""
    session = f"web:{chat_id}"
    doc = OutboundMessage(
        type="message",
        channel="web",
        chat_id=chat_id,
        session_key=session,
        reply_to="m-" + content,
        content=content,
    )
    entry_id = admin.xadd(K.out(session), {"payload": doc.model_dump_json()})
    admin.xadd(K.pulse("web"), {"o": K.out(session)})
    return entry_id


@pytest.mark.real_redis
def test_a_websocket_subscription_after_the_number_0_is_not_taken_as_only_new_events(
    redis_server: Any,
) -> None:
    """``_handle`` reads the cursor as ``str(frame.get("after") or "$")``: the JSON number
    0 (falsy) becomes ``$``. A client asking for everything kept (``?after=0`` on SSE)
    with a number is told it is subscribed, and every event already written is skipped
    (lost for it); any other number is refused as an invalid cursor. It should be taken
    as ``0`` (replayed) or refused with an error frame. Fix: ``after = frame.get("after")``,
    ``"$"`` only when it is missing or null, and a non-string refused. A real gateway
    process (starlette's TestClient, cancelling the app as the socket closes, failed
    now and then under load)."""
    from gateways import GatewayProcess
    from redis import Redis
    from websockets.sync.client import connect

    gw = GatewayProcess(
        redis_server.url, name="ws-after-0", env={"AGENT_GATEWAY_TOKENS": TOKENS_ENV}
    )
    admin = Redis.from_url(redis_server.url, decode_responses=True)
    try:
        sid = httpx.post(f"{gw.url}/api/sessions", json={}, headers=ALICE).json()["id"]
        old = _add_event(admin, sid, "already answered")
        url = f"ws://127.0.0.1:{gw.port}/api/ws"
        with connect(url, additional_headers=dict(ALICE), open_timeout=5) as ws:
            ws.send(json.dumps({"op": "subscribe", "session_id": sid, "after": 0}))
            frame = json.loads(ws.recv(timeout=5))
            if frame["type"] == "subscribed":
                new = _add_event(admin, sid, "answered later")
                frame = json.loads(ws.recv(timeout=5))
                assert frame["type"] == "event", frame
                assert frame["id"] == old, (
                    f'subscribed with "after": 0; the first event given is {frame["id"]} '
                    f"({'the new one' if frame['id'] == new else '?'}), not {old}"
                )
            else:
                assert frame["type"] == "error", frame
    finally:
        admin.close()
        gw.close()


@pytest.mark.real_redis
def test_a_websocket_frame_naming_a_lone_surrogate_is_answered_and_the_socket_serves_on(
    redis_server: Any,
) -> None:
    """A subscribe frame whose ``session_id`` is a lone surrogate (``"\\ud800"``: valid
    JSON, and the socket's text is UTF-8) is refused with an error frame that echoes the
    id; uvicorn encodes the frame's text as UTF-8, the encode raises in ``_write``, which
    catches only disconnects, and the socket's writer task is gone. The socket is not
    closed: it answers nothing any more (no error frame, no ``subscribed`` for a good
    chat), silently, while its subscriptions hold the user's stream slots until 512
    frames pile up. Every malformed frame should get an error frame and the socket serve
    on. Fix: do not echo what the client sent (or send with ``ensure_ascii=True``), and
    end the connection when the writer fails for any reason. A real gateway process
    (starlette's TestClient does not encode)."""
    from gateways import GatewayProcess
    from websockets.sync.client import connect

    gw = GatewayProcess(
        redis_server.url, name="ws-surrogate", env={"AGENT_GATEWAY_TOKENS": TOKENS_ENV}
    )
    try:
        sid = httpx.post(f"{gw.url}/api/sessions", json={}, headers=ALICE).json()["id"]
        url = f"ws://127.0.0.1:{gw.port}/api/ws"
        with connect(url, additional_headers=dict(ALICE), open_timeout=5) as ws:
            ws.send('{"op": "subscribe", "session_id": "\\ud800"}')
            ws.send(json.dumps({"op": "subscribe", "session_id": sid, "after": "$"}))
            frames = []
            try:
                while len(frames) < 2:
                    frames.append(json.loads(ws.recv(timeout=5)))
            except TimeoutError:
                pass
        types = [f["type"] for f in frames]
        assert types == ["error", "subscribed"], f"frames in 5 s: {frames}"
    finally:
        gw.close()


# --- 8. the OpenAI route's own refusals, in OpenAI's shape (mine, after the attack) ------------


async def test_an_openai_conversation_refused_is_answered_as_openai_errors_are(
    redis_factory: Any,
) -> None:
    """An unknown ``X-Session-Id`` and a caller past its chats were FastAPI's
    ``{"detail": ...}`` (an SDK reads ``error.message``), and the 409 was retried by the
    openai SDK though a retry meets the same limit. Now both are OpenAI errors, the 409
    with ``x-should-retry: false``."""
    async with _client(redis_factory, max_sessions_per_user=1) as http:
        body = {"messages": [{"role": "user", "content": "hi"}]}
        headers = {**JSON_ALICE, "X-Session-Id": "nope"}
        r = await http.post("/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 404
        assert r.json()["error"]["message"] == "no such session"
        await http.post("/api/sessions", json={}, headers=ALICE)  # (its one chat)
        r = await http.post(
            "/v1/chat/completions", json={**body, "user": "bob"}, headers=JSON_ALICE
        )
        assert r.status_code == 409, r.text
        assert "error" in r.json()
        assert r.headers["x-should-retry"] == "false"


def test_an_event_stream_another_sites_page_opens_is_refused() -> None:
    """Behind an authenticating proxy, a page of another site can make the user's browser
    GET a chat's event stream (an ``<img>``, an ``EventSource`` with credentials): the
    browser hides the answer, but the stream is opened in the user's name and holds one
    of the user's few stream slots while the page stays open. SameOrigin checked only
    WebSockets and unsafe methods; a GET of ``/events`` from another site is refused now
    (a page of the gateway's own origin, and a client that is no browser, still read)."""
    from test_gateway_hostile import _proxied_app

    app, _ = _proxied_app()
    with TestClient(app, client=("127.0.0.1", 5555)) as c:
        user = {"X-Forwarded-User": "alice"}
        sid = c.post("/api/sessions", json={}, headers=user).json()["id"]
        path = f"/api/sessions/{sid}/events"
        for foreign in ({"Sec-Fetch-Site": "cross-site"}, {"Origin": "https://evil.example"}):
            with c.stream("GET", path, headers={**user, **foreign}) as r:
                assert r.status_code == 403, f"{foreign}: {r.status_code}"
