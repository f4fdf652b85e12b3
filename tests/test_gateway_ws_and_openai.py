"""The gateway (the HTTP front door) as a hostile reviewer attacked it: WebSocket resume
and re-subscription, a deeply nested frame, the OpenAI-compatible endpoint's end users and
its last message, a cursor past every event. Each test failed on the code before its fix. In process (starlette's TestClient over the ASGI app,
fakeredis); events are added to a chat's stream as a worker adds them. No worker code."""

from __future__ import annotations

import json
from typing import Any

import fakeredis
import pytest
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from bus_redis import OutboundMessage
from bus_redis.keys import Keys
from gateway.app import Gateway, create_app
from gateway.settings import GatewaySettings

pytestmark = pytest.mark.frontend
K = Keys()
ALICE = {"Authorization": "Bearer alice-token-123"}
BOB = {"Authorization": "Bearer bob-token-456"}
TOKENS = {"alice-token-123": "alice", "bob-token-456": "bob"}


def _app(**kw: Any) -> tuple[Any, Gateway, fakeredis.FakeRedis]:
    server = fakeredis.FakeServer()

    def make() -> fakeredis.FakeAsyncRedis:
        return fakeredis.FakeAsyncRedis(server=server, decode_responses=True)

    settings = GatewaySettings(**{"tokens": TOKENS, **kw})
    gw = Gateway(settings, make(), [make()])
    gw.hub.block_ms = 100  # (a fake blocked read ends only at its timeout: the app's end waits it)
    admin = fakeredis.FakeRedis(server=server, decode_responses=True)
    return create_app(settings, gw), gw, admin


def _add_events(admin: fakeredis.FakeRedis, chat_id: str, texts: list[str]) -> list[str]:
    """Events of a chat as a worker adds them: to its stream, its name to the pulse."""
    session = f"web:{chat_id}"
    ids = []
    for i, content in enumerate(texts):
        doc = OutboundMessage(
            type="message",
            channel="web",
            chat_id=chat_id,
            session_key=session,
            reply_to=f"m{i}",
            content=content,
        )
        ids.append(admin.xadd(K.out(session), {"payload": doc.model_dump_json()}))
        admin.xadd(K.pulse("web"), {"o": K.out(session)})
    return ids


def test_a_websocket_that_resumes_a_chat_with_long_answers_is_not_dropped_as_too_slow() -> None:
    """A chat keeps up to AGENT_REPLY_MAXLEN (1,000) events; 150 answers of 30,000
    characters each (a few long code answers) are 4.5 MB. A client that subscribes after
    its last cursor (here: from the start) and reads as fast as it can must get them.
    The pump puts a whole catch-up batch (200 entries) into the outbox without letting
    the writer run, so the outbox's 4 MiB bound is crossed before one frame is written:
    the socket is closed 1013 "too slow" and the queued frames are thrown away. The
    client resumes from the same cursor and is dropped at the same place every time."""
    app, _gw, admin = _app()
    with TestClient(app) as c:
        sid = c.post("/api/sessions", json={}, headers=ALICE).json()["id"]
        ids = _add_events(admin, sid, [f"{i:05d}" + "x" * 30_000 for i in range(150)])
        got: list[str] = []
        closed: str | None = None
        with c.websocket_connect("/api/ws", headers=ALICE) as ws:
            ws.send_text(json.dumps({"op": "subscribe", "session_id": sid, "after": "0"}))
            try:
                while len(got) < len(ids):
                    frame = ws.receive_json()
                    if frame["type"] == "event":
                        got.append(frame["id"])
            except WebSocketDisconnect as exc:
                closed = f"closed {exc.code} {exc.reason!r}"
        assert closed is None, (
            f"a client reading as fast as it can: {closed} after {len(got)} events"
        )
        assert got == ids


def _payloads(admin: fakeredis.FakeRedis, chat_id: str) -> list[dict[str, Any]]:
    """The messages queued for a chat's session (what the workers will run)."""
    entries = admin.xrange(K.inbound(f"web:{chat_id}"))
    return [json.loads(f["payload"]) for _id, f in entries if "payload" in f]


def _oa_chat(user: str, end_user: str) -> str:
    import hashlib

    h = hashlib.sha256(user.encode()).hexdigest()[:24]
    return f"{h}-oa-{hashlib.sha256(f'openai|{end_user}'.encode()).hexdigest()[:24]}"


def test_openai_end_users_of_one_bot_do_not_share_a_scope() -> None:
    """README: the OpenAI conversation is "one per (caller, request `user` field) — a bot
    passes its end user's id". Each end user gets a chat of their own, but every one of
    them is sent under the caller's scope (``user-<h>``), and the scope is what long-term
    memory (in every durable prompt) and ``read_session`` / ``search_sessions`` are
    confined to: end user "mallory" asks the agent to search the sessions, or just reads
    the memory consolidated from "victim"'s conversation."""
    import hashlib

    app, _gw, admin = _app(wait_max_s=0.05)  # nothing answers here: 504 once sent
    with TestClient(app) as c:
        for end_user in ("victim", "mallory"):
            r = c.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": f"hi from {end_user}"}],
                      "user": end_user},
                headers=ALICE,
            )  # fmt: skip
            assert r.status_code == 504, r.text
        victim = _payloads(admin, _oa_chat("alice", "victim"))
        mallory = _payloads(admin, _oa_chat("alice", "mallory"))
        assert [p["content"] for p in victim] == ["hi from victim"]
        assert [p["content"] for p in mallory] == ["hi from mallory"]
        assert victim[0]["scope"] != mallory[0]["scope"], (
            f"two end users' conversations share scope {victim[0]['scope']!r}: memory and "
            "session search cross between them"
        )
        # ... and both count as the caller's own against the per-scope limits (schedules,
        # sessions running subagents): naming many end users takes no more than one share
        h = hashlib.sha256(b"alice").hexdigest()[:24]
        assert victim[0]["quota"] == mallory[0]["quota"] == f"user-{h}", (victim, mallory)


def test_an_openai_request_with_no_new_user_message_does_not_run_an_old_one_again() -> None:
    """An OpenAI client running its own tools sends [user, assistant(tool_calls), tool];
    a client showing the reply sends [user, assistant]. Neither has a new user message.
    The gateway takes "the last user message" wherever it is, so the question the agent
    already answered is queued again as a new turn (run twice, answered twice, stored
    twice in the history) and the tool result is dropped."""
    app, _gw, admin = _app(wait_max_s=0.05)
    with TestClient(app) as c:
        first = c.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "what is the weather?"}]},
            headers=ALICE,
        )
        assert first.status_code == 504  # sent, nothing answers here
        again = c.post(
            "/v1/chat/completions",
            json={
                "messages": [
                    {"role": "user", "content": "what is the weather?"},
                    {"role": "assistant", "content": None,
                     "tool_calls": [{"id": "c1", "type": "function",
                                     "function": {"name": "weather", "arguments": "{}"}}]},
                    {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21C"},
                ]
            },
            headers=ALICE,
        )  # fmt: skip
        sent = [p["content"] for p in _payloads(admin, _oa_chat("alice", ""))]
        assert sent == ["what is the weather?"], f"HTTP {again.status_code}; queued turns: {sent}"


def test_resubscribing_a_chat_at_the_per_user_stream_limit_keeps_following_it() -> None:
    """Subscribing again to a chat the socket follows (a new cursor, e.g. after a gap or
    a history reload) replaces its subscription: it needs no more room. ``_handle``
    cancels the old pump and starts the new one at once; the old one has not given its
    stream back yet, so at ``max_streams_per_user`` the new one is refused ("N streams
    per user") and the old one is gone: the socket silently follows nothing for that
    chat any more."""
    app, _gw, admin = _app(max_streams_per_user=2)
    with TestClient(app) as c:
        a = c.post("/api/sessions", json={}, headers=ALICE).json()["id"]
        b = c.post("/api/sessions", json={}, headers=ALICE).json()["id"]
        first = _add_events(admin, a, ["one"])[0]
        with c.websocket_connect("/api/ws", headers=ALICE) as ws:
            for sid in (a, b):
                ws.send_text(json.dumps({"op": "subscribe", "session_id": sid, "after": "$"}))
                assert ws.receive_json()["type"] == "subscribed"
            ws.send_text(json.dumps({"op": "subscribe", "session_id": a, "after": "0"}))
            frame = ws.receive_json()
            assert frame["type"] == "subscribed", f"re-subscribing chat a: {frame}"
            assert ws.receive_json()["id"] == first


def test_a_cursor_past_everything_the_chat_has_is_not_taken_silently() -> None:
    """A cursor beyond the chat's last event (the maximal stream id, or another chat's
    newer id: a client mixing up its cursors) is accepted with no gap and no error:
    every event of the chat up to that id is skipped, i.e. for the maximal id every
    event for ever, while the client is told it is subscribed. No cursor a client was
    ever given for this chat is past its last event (sends, history and events give
    ids of this stream), so it should be refused (400 / error frame) or answered gap."""
    app, _gw, admin = _app()
    top = f"{2**64 - 1}-{2**64 - 1}"
    with TestClient(app) as c:
        sid = c.post("/api/sessions", json={}, headers=ALICE).json()["id"]
        last = _add_events(admin, sid, ["one"])[0]
        with c.websocket_connect("/api/ws", headers=ALICE) as ws:
            ws.send_text(json.dumps({"op": "subscribe", "session_id": sid, "after": top}))
            frame = ws.receive_json()
            if frame["type"] == "subscribed":  # (then what became of the cursor)
                frame = ws.receive_json()
        assert frame["type"] in ("error", "gap"), (
            f"after {top} (the chat's last event is {last}): {frame}"
        )


async def test_a_deeply_nested_frame_is_answered_with_an_error_not_the_sockets_end() -> None:
    """Every malformed frame gets ``{"type": "error"}`` and the socket stays open, but a
    frame of 2,000 ``[`` (well under the 4,096 characters a frame may have) makes
    ``json.loads`` raise RecursionError, which ``_handle`` does not catch; ``_receive``
    takes it (a RuntimeError) for a closed socket and ends the connection, dropping every
    subscription of the socket without a close frame (starlette's TestClient then waits
    for ever, so ``_handle`` is called here directly)."""
    from gateway.ws import Connection

    conn = Connection(None, None, None)  # type: ignore[arg-type]
    try:
        await conn._handle("[" * 2000)
    except RecursionError:
        pytest.fail("a 2,000-byte frame of '[' raised RecursionError out of _handle")
    frame, _size = conn.outbox.get_nowait()
    assert frame["type"] == "error"
