"""Hostile users behind the gateway (a review of 0a3568b): each test failed on 0a3568b
for the reason its docstring gives. A sixth finding (a resume's catch-up read held a
batch of 200 events of any size) is tested in ``test_gateway_hub.py``. In
process (starlette's TestClient or httpx over ASGI, fakeredis); a worker's events are
written to a chat's stream as a worker writes them. No sleeps synchronize anything: a
timeout only bounds a test that would otherwise hang."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import fakeredis
import pytest
from starlette.testclient import TestClient
from test_gateway_ws_and_openai import _oa_chat, _payloads

from bus_redis import OutboundMessage
from bus_redis.keys import Keys
from gateway.app import Gateway, create_app
from gateway.settings import GatewaySettings
from gateway.subscription import BUFFER_BYTES, HubEvent, Subscription

pytestmark = pytest.mark.frontend
K = Keys()
ALICE_TOKEN = "alice-token-123"
ALICE = {"Authorization": f"Bearer {ALICE_TOKEN}"}
TOKENS = {ALICE_TOKEN: "alice", "bob-token-456": "bob"}


def _gateway(**kw: Any) -> tuple[Gateway, fakeredis.FakeServer]:
    server = fakeredis.FakeServer()

    def make() -> fakeredis.FakeAsyncRedis:
        return fakeredis.FakeAsyncRedis(server=server, decode_responses=True)

    settings = GatewaySettings(**{"tokens": TOKENS, **kw})
    gw = Gateway(settings, make(), [make()])
    gw.hub.block_ms = 100  # (a fake blocked read ends only at its timeout)
    return gw, server


def _app(**kw: Any) -> tuple[Any, Gateway, fakeredis.FakeRedis]:
    gw, server = _gateway(**kw)
    admin = fakeredis.FakeRedis(server=server, decode_responses=True)
    return create_app(gw.settings, gw), gw, admin


def _event(session: str, kind: str, content: str, reply_to: str, **extra: Any) -> str:
    return OutboundMessage(
        type=kind,  # type: ignore[arg-type]
        channel="web",
        chat_id=session.partition(":")[2],
        session_key=session,
        reply_to=reply_to,
        content=content,
        **extra,
    ).model_dump_json()


# --- event bytes a user controls: the metadata every answer echoes -------------------------


def _echoing_answer(n: int, pad: int) -> HubEvent:
    """The answer a worker writes to a message whose ``metadata`` the user padded: the
    worker's reply carries ``{**msg.metadata, "worker": ...}`` (worker/runtime/
    execution.py), so a 200 KB ``metadata`` (the payload limit is 256 KiB) comes back
    in the answer event, whatever the answer's text."""
    event = OutboundMessage(
        type="message",
        channel="web",
        chat_id="c",
        session_key="web:c",
        reply_to=f"m{n}",
        content="ok",
        metadata={"pad": "x" * pad, "worker": "w1"},
    )
    return HubEvent("event", f"{n}-0", event)


def test_a_subscribers_buffer_counts_the_metadata_it_holds() -> None:
    """Promise: a user cannot make a replica hold memory in proportion to what they send
    (docs/ARCHITECTURE.md: a subscriber "that falls 256 entries (or 1 MiB of their text)
    behind drops its buffer"). ``event_size`` counts an event's ``content`` only, and the
    user chooses the ``metadata`` the answers echo: 256 answers of 200 KB of metadata
    (a few seconds of sends; then 64 streams of a stalled reader per replica) are all
    buffered, 50 MB per subscription, with ``buffered_bytes`` at 512."""
    sub = Subscription(hub=None, stream="s", cursor="0-0")  # type: ignore[arg-type]
    sub.catch_up = False
    for n in range(1, 257):
        sub.push(_echoing_answer(n, 200_000))
    held = sum(len(ev.event.model_dump_json()) for ev in sub.buffer if ev.event is not None)
    assert held <= BUFFER_BYTES + 256_000, (
        f"{len(sub.buffer)} events, {held} bytes buffered for one stalled subscriber "
        f"(bound {BUFFER_BYTES}; counted: {sub.buffered_bytes})"
    )


async def test_a_websocket_outbox_counts_the_metadata_it_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Promise: as above, for one WebSocket: "leaving 1 MiB of answers unread" / the
    outbox's ``OUTBOX_BYTES`` (4 MiB). ``_pump`` queues each event with
    ``event_size(ev)`` (its text only), so a client that stops reading is sent 512 frames
    of 200 KB of echoed metadata (100 MB per socket) and is never let go by bytes."""
    from gateway import ws as wsmod
    from gateway.chats import Chat

    monkeypatch.setattr(wsmod, "ROOM_WAIT_S", 0.0)  # (a client that reads nothing)
    answers = [_echoing_answer(n, 200_000) for n in range(1, 41)]  # 8 MB in all

    class Sub:
        cursor = "0-0"

        async def events(self, _keepalive: float) -> AsyncIterator[HubEvent]:
            for ev in answers:
                yield ev

    @asynccontextmanager
    async def subscribe(*_a: Any) -> AsyncIterator[Sub]:
        yield Sub()

    gw = type("G", (), {"subscribe": staticmethod(subscribe)})()
    gw.settings = type("S", (), {"keepalive_s": 1.0})()
    conn = wsmod.Connection(gw, None, None)  # type: ignore[arg-type]
    await conn._pump(Chat("c", "web:c", False), "0")
    held = 0
    while not conn.outbox.empty():
        frame, _size = conn.outbox.get_nowait()
        held += len(json.dumps(frame))
    assert held <= wsmod.OUTBOX_BYTES + 256_000, (
        f"{held} bytes queued for a socket that reads nothing (bound {wsmod.OUTBOX_BYTES}; "
        f"counted {conn.queued_bytes}, overflowed={conn.overflowed})"
    )


# --- the OpenAI-compatible endpoint --------------------------------------------------------


def test_an_openai_stream_does_not_echo_a_huge_model_name_in_every_chunk() -> None:
    """Promise: a user cannot make a replica do work in proportion to what they send
    (here: more). ``model`` is any string up to the body limit (1 MiB) and ``_stream``
    puts it in every chunk: one request naming a 200 KB model, answered in 50 deltas,
    makes the replica serialise and send 10 MB (a long answer in 2,000 deltas: 400 MB
    on the event loop every user shares) for a request of 200 KB."""
    app, gw, _admin = _app()
    original = gw.publish

    async def publish(user: Any, chat: Any, msg: Any) -> set[str]:
        ids = await original(user, chat, msg)
        # the worker answers: 50 deltas, then the message (in the stream before the
        # completion subscribes: its catch-up reads them, no timing involved)
        for n in range(50):
            doc = _event(chat.session_key, "delta", "a", msg.id, metadata={"seq": n + 1})
            await gw.redis.xadd(K.out(chat.session_key), {"payload": doc})
        doc = _event(chat.session_key, "message", "a" * 50, msg.id)
        await gw.redis.xadd(K.out(chat.session_key), {"payload": doc})
        return ids

    gw.publish = publish  # type: ignore[method-assign]
    model = "m" * 200_000
    with TestClient(app) as c:
        r = c.post(
            "/v1/chat/completions",
            json={"model": model, "stream": True, "messages": [{"role": "user", "content": "hi"}]},
            headers=ALICE,
        )
    if r.status_code in (400, 413, 422):
        return  # refused: fine
    streamed = len(r.content)
    assert streamed < 1_000_000, (
        f"a 50-character answer to a {len(model)}-character model name: {streamed} bytes streamed"
    )


async def test_an_openai_client_retrying_a_504_does_not_run_the_question_again() -> None:
    """Promise: nothing the user sends is run twice. The completion waits at most
    ``AGENT_GATEWAY_WAIT_MAX_S``; a slow answer is 504 although the question is queued.
    The OpenAI SDK (the client this endpoint is for) retries 408, 409, 429 and 5xx by
    itself (``max_retries=2`` by default) unless told ``x-should-retry: false``, and each
    retry is a new message with a new id: the agent is asked the same question three
    times (three turns, three answers in the history). The same goes for 429 "too many
    open streams" after sending, 409 ``cancelled`` (a stop the user pressed is undone by
    the retry) and 502 ``provider_error``."""
    import httpx2
    from openai import APIStatusError, AsyncOpenAI

    gw, server = _gateway(wait_max_s=0.2)  # nothing answers here
    admin = fakeredis.FakeRedis(server=server, decode_responses=True)
    app = create_app(gw.settings, gw)
    gw.hub.start()
    app.state.gw = gw
    transport = httpx2.ASGITransport(app=app)
    try:
        async with httpx2.AsyncClient(transport=transport, base_url="http://gw/v1") as http:
            client = AsyncOpenAI(api_key=ALICE_TOKEN, base_url="http://gw/v1", http_client=http)
            with pytest.raises(APIStatusError) as failed:
                await client.chat.completions.create(
                    model="agent", messages=[{"role": "user", "content": "book one table"}]
                )
            assert failed.value.status_code == 504
    finally:
        await gw.hub.stop()
    sent = [p["content"] for p in _payloads(admin, _oa_chat("alice", ""))]
    assert sent == ["book one table"], f"queued turns for one question: {sent}"


# --- cursors ---------------------------------------------------------------------------------


async def test_a_cursor_past_an_empty_chat_does_not_hide_its_next_events() -> None:
    """Promise: nothing is lost on resume. A cursor past every event is answered ``gap``
    and the stream goes on from the chat's last event (the fix of
    test_a_cursor_past_everything_the_chat_has_is_not_taken_silently), but only when
    the chat has events: for a chat with none (new, or its events expired or deleted),
    ``_start_point`` keeps the cursor, so after the ``gap`` every event the chat ever
    gets is skipped as already seen; the WebSocket says ``subscribed`` with that cursor
    and an EventSource reconnects with it (the gap's ``id``) and gets the same."""
    gw, server = _gateway()
    admin = fakeredis.FakeAsyncRedis(server=server, decode_responses=True)
    session = "web:empty"
    top = f"{2**64 - 1}-{2**64 - 1}"
    async with gw.hub.subscribe(session, top) as sub:
        eid = await admin.xadd(
            K.out(session), {"payload": _event(session, "message", "hello", "m1")}
        )
        got: list[HubEvent | None] = []
        events = sub.events(0.05)
        while len(got) < 2:
            got.append(await asyncio.wait_for(events.__anext__(), 10))
        await events.aclose()
    assert got[0] is not None
    assert got[0].kind == "gap"
    assert got[1] is not None, (
        f"after the gap: {got[1]} instead of the chat's event {eid} (the subscription's "
        f"cursor is still {sub.cursor})"
    )
    assert got[1].entry_id == eid


# --- what a worker would refuse is refused before it is sent ---------------------------------


def test_a_message_over_the_workers_payload_limit_is_refused_not_sent() -> None:
    """A request body may be 1 MiB while a worker refuses a payload over 256 KiB
    (``AGENT_MAX_PAYLOAD_BYTES``): 100,000 four-byte characters (400 KB), or 300 KB of
    message metadata, were queued, answered ``too_large`` and dead-lettered (a review of
    the gateway). They are refused with 413 now, nothing queued; a message that fits is
    sent."""
    app, _gw, admin = _app(wait_max_s=0.05)  # nothing answers here: 504 once sent
    with TestClient(app) as c:
        sid = c.post("/api/sessions", json={}, headers=ALICE).json()["id"]
        send = f"/api/sessions/{sid}/messages"
        padded = {"content": "hi", "metadata": {"pad": "x" * 300_000}}
        r = c.post(send, json=padded, headers=ALICE)
        assert r.status_code == 413, r.text
        wide = {"messages": [{"role": "user", "content": "\U0001f600" * 70_000}]}
        r = c.post("/v1/chat/completions", json=wide, headers=ALICE)
        assert r.status_code == 413, r.text
        assert r.headers.get("x-should-retry") != "true"
        assert _payloads(admin, sid) == []
        assert _payloads(admin, _oa_chat("alice", "")) == []
        r = c.post(send, json={"content": "hi", "metadata": {"pad": "x" * 200_000}}, headers=ALICE)
        assert r.status_code == 202, r.text
        assert [p["content"] for p in _payloads(admin, sid)] == ["hi"]


def test_an_openai_request_sent_again_with_its_idempotency_key_is_the_same_message() -> None:
    """A completion whose replica dies mid-request is sent again by the client (the openai
    SDK retries a cut connection): without a key each try was a new message, so the
    question ran twice (a review of the gateway). With an ``Idempotency-Key`` header the
    tries are one message id, which a worker runs once and answers again with its first
    answer; another key, or another conversation, is another message."""
    app, _gw, admin = _app(wait_max_s=0.05)  # nothing answers here: 504 once sent
    ask = {"messages": [{"role": "user", "content": "book one table"}]}
    with TestClient(app) as c:
        for key, end_user in [("k-1", ""), ("k-1", ""), ("k-2", ""), ("k-1", "bob")]:
            body = {**ask, "user": end_user} if end_user else ask
            r = c.post("/v1/chat/completions", json=body,
                       headers={**ALICE, "Idempotency-Key": key})  # fmt: skip
            assert r.status_code == 504, r.text
        r = c.post("/v1/chat/completions", json=ask, headers={**ALICE, "Idempotency-Key": "a b"})
        assert r.status_code == 422, r.text
    ids = [p["id"] for p in _payloads(admin, _oa_chat("alice", ""))]
    assert len(ids) == 3, ids
    assert ids[0] == ids[1] != ids[2], ids
    [other] = [p["id"] for p in _payloads(admin, _oa_chat("alice", "bob"))]
    assert other not in ids
