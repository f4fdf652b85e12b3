"""The gateway attacked a fifth time, as a hostile user and a hostile frontend (a review of
ebacb12). Each test fails on ebacb12 for the reason its docstring gives.

- The OpenAI-compatible endpoint decides a message's scope from the request (its ``user``
  field), not from the chat the message goes to. A chat's scope is fixed by its first
  message (the workers refuse a later message of another scope, ``invalid_message``), so
  a conversation the gateway itself made and lists as the caller's cannot be continued
  by the ``X-Session-Id`` the response named, nor from the JSON API or the chat page; and
  an ``X-Session-Id`` chat sent with the SDK's ``user`` field is refused every time. Run
  against a real worker (it is the worker that refuses).
- A message whose ``metadata`` nests deep is answered 500 (an unhandled serialisation
  error), not 422 as invalid input is.
- A send with ``?wait=`` that cannot follow its chat's events (the user's streams filled
  up while it was being sent) is answered 429 although the message was queued: HTTP's
  "too many requests, try again" for a request that was carried out. A client retrying it
  (as 429 says to) asks the same question twice.

In process (httpx over ASGI, fakeredis) where no worker is needed; a real deployment
(``tests/stacks.py``: redis-server, ACL users, a worker process, a gateway process) where
the worker's verdict is the point. No sleeps synchronize anything.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import fakeredis
import httpx
import pytest
from stacks import ALICE, Stack, running_stack

from bus_redis.keys import Keys
from gateway.app import Gateway, create_app
from gateway.settings import GatewaySettings

pytestmark = pytest.mark.frontend
K = Keys()
IN_ALICE = {"Authorization": "Bearer alice-token-123"}
TOKENS = {"alice-token-123": "alice", "bob-token-456": "bob"}


# --- in process -----------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _serving(**settings: Any) -> AsyncIterator[tuple[httpx.AsyncClient, fakeredis.FakeRedis]]:
    """The gateway's app in process over fakeredis (its event hub running), and an admin
    connection to the same fake server."""
    server = fakeredis.FakeServer()

    def make() -> fakeredis.FakeAsyncRedis:
        return fakeredis.FakeAsyncRedis(server=server, decode_responses=True)

    gw = Gateway(GatewaySettings(**{"tokens": TOKENS, **settings}), make(), [make()])
    gw.hub.block_ms = 100  # (a fake blocked read ends only at its timeout)
    app = create_app(gw.settings, gw)
    gw.hub.start()
    app.state.gw = gw
    admin = fakeredis.FakeRedis(server=server, decode_responses=True)
    transport = httpx.ASGITransport(
        app=app, client=("127.0.0.1", 40000), raise_app_exceptions=False
    )  # (an unhandled error is the 500 a client gets)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            yield http, admin
    finally:
        await gw.hub.stop()
        admin.close()


def _queued(admin: fakeredis.FakeRedis, chat_id: str) -> int:
    """Entries in the chat's inbound stream: what was sent to the workers."""
    return int(admin.xlen(K.inbound(f"web:{chat_id}")))


async def test_a_message_with_deeply_nested_metadata_is_refused_as_invalid_not_a_500() -> None:
    """Attack: a send whose ``metadata`` holds a value nested 300 levels deep
    (``{"x": [[[...]]]}``, 600 bytes; the body is well under every size limit, and
    Starlette's parser reads it fine).

    What happened: 500 Internal Server Error. ``NewMessage.metadata`` is ``dict[str, Any]``
    (any depth), and ``Gateway.publish`` serialises the message with pydantic
    (``msg.model_dump_json``, gateway/app.py:138), which raises
    ``PydanticSerializationError: Maximum serialization depth exceeded`` at 255 levels;
    nothing catches it (only ``RequestValidationError`` and ``RedisError`` have handlers).
    A client library retries a 5xx; the server's log gets a traceback per request.
    (Metadata 33 to 254 levels deep is answered 202 and then refused by the worker,
    ``invalid_message``: bus_redis/schema.py ``MAX_DEPTH`` = 32.)

    Expected: invalid input is a 4xx (docs/SECURITY.md: "Invalid input gets 422 naming
    what failed where"), and nothing is sent."""
    async with _serving() as (http, admin):
        r = await http.post("/api/sessions", json={}, headers=IN_ALICE)
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        depth = 300
        body = '{"content": "hello", "metadata": {"x": %s}}' % ("[" * depth + "]" * depth)
        r = await http.post(
            f"/api/sessions/{sid}/messages",
            content=body.encode(),
            headers={**IN_ALICE, "Content-Type": "application/json"},
        )
        assert r.status_code < 500, (
            f"metadata nested {depth} deep: {r.status_code} {r.text[:200]!r} (expected a 4xx "
            "refusal of invalid input)"
        )
        assert r.status_code in (413, 422), r.text
        assert _queued(admin, sid) == 0


async def test_a_send_answered_429_was_not_sent() -> None:
    """Attack: two ``?wait=`` sends to one chat at once, the user one stream short of
    ``AGENT_GATEWAY_MAX_STREAMS_PER_USER`` (here 1, so that one more wait fills it; the
    same happens at 64 with 63 SSE streams or waits open). Both pass the room check
    (``Gateway.has_room``, gateway/api.py:193) before either has subscribed.

    What happened: the second is answered ``429 {"detail": "sent, but cannot wait: ..."}``
    (gateway/api.py:208) although its message is queued for the workers: both messages are
    in the chat's stream. 429 tells a client to try again (the README's 429s of a send —
    "too much of the user's is waiting", the rate — all mean nothing was sent): a client
    that does, as any HTTP client's retry policy and the OpenAI SDK do, sends the question
    a second time and gets two turns (a send without ``client_id`` gets a new id each time).
    Here the client retries once: three messages queued for two questions.

    Expected: a send that was queued is answered as one (202 with its ``message_id`` and
    ``cursor``, as a wait that ran out: the client follows the events itself), never with
    a status that says "not done, retry"; a 429 only when nothing was sent."""
    async with _serving(max_streams_per_user=1) as (http, admin):
        r = await http.post("/api/sessions", json={}, headers=IN_ALICE)
        assert r.status_code == 201, r.text
        sid = r.json()["id"]

        async def send(text: str) -> httpx.Response:
            return await http.post(
                f"/api/sessions/{sid}/messages?wait=0.3", json={"content": text}, headers=IN_ALICE
            )

        first = await asyncio.gather(send("question one"), send("question two"))
        answered = [r for r in first if r.status_code in (200, 202)]
        refused = [r for r in first if r.status_code == 429]
        assert len(answered) + len(refused) == 2, [(r.status_code, r.text) for r in first]
        for _ in refused:  # a client doing what 429 says: the same request again, later
            retried = await send("question two")
            assert retried.status_code in (200, 202, 429), retried.text
            if retried.status_code != 429:
                answered.append(retried)
        queued = _queued(admin, sid)
        assert queued == len(answered), (
            f"answered {[(r.status_code, r.text) for r in first]}; {queued} messages queued "
            f"for 2 questions, {len(answered)} sends answered as accepted: a 429 was given "
            "for a message that had been sent"
        )


# --- a real deployment: the worker decides a scope mismatch ---------------------------------


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with running_stack(gateways=1, workers=1) as st:
        yield st


def _completion(http: httpx.Client, base: str, text: str, **kw: Any) -> httpx.Response:
    headers = {**ALICE, **kw.pop("headers", {})}
    body = {"model": "agent", "messages": [{"role": "user", "content": text}], **kw}
    return http.post(f"{base}/v1/chat/completions", json=body, headers=headers)


@pytest.mark.real_redis
@pytest.mark.slow
def test_an_openai_end_users_conversation_can_be_continued_by_its_session_id(
    stack: Stack,
) -> None:
    """Attack (no malice needed): a bot talks to the OpenAI endpoint with the ``user``
    field (its end user's id, as the README says to); the response's ``X-Session-Id``
    names the conversation, and ``GET /api/sessions`` lists it as one of the caller's.
    The bot then continues that conversation by its ``X-Session-Id`` (README: "The
    conversation is the chat named by the X-Session-Id header (one of the caller's)"),
    and the caller opens it on the chat page (the JSON API) and types in it.

    What happened: both are answered ``invalid_message`` ("the message's scope does not
    match its session's scope"): HTTP 400 on the OpenAI endpoint, an ``error`` event on
    the JSON API. The first message fixed the session's scope to the end user's
    (``user-<h>-oa-<digest>``), and every later message is sent with the scope the
    *request* implies: ``user-<h>`` without a ``user`` field
    (gateway/openai_compat.py:97-100; the JSON API always sends ``user-<h>``,
    gateway/app.py:102). The conversation is listed, owned, and cannot take another
    message by any route but the exact ``user`` field it began with.

    Expected: a chat's messages carry the chat's scope (for an ``-oa-<digest>`` chat,
    the end user's scope its id names), whichever route sends them; the messages are
    answered."""
    with httpx.Client(timeout=30) as http:
        r = _completion(http, stack.a, "hello from end user u2", user="u2")
        assert r.status_code == 200, r.text
        oa_chat = r.headers["x-session-id"]
        listed = [c["id"] for c in http.get(f"{stack.a}/api/sessions", headers=ALICE).json()]
        assert oa_chat in listed, listed

        again = _completion(http, stack.a, "and again", headers={"X-Session-Id": oa_chat})
        page = http.post(
            f"{stack.a}/api/sessions/{oa_chat}/messages?wait=20",
            json={"content": "typed on the chat page"},
            headers=ALICE,
        )
        assert page.status_code in (200, 202), page.text
        event = page.json().get("event") or {}
    assert again.status_code == 200, (
        f"continuing the conversation the response named: {again.status_code} {again.text}"
    )
    assert event.get("type") == "message", (
        f"a message typed in a listed chat of the caller's was answered {event}"
    )


@pytest.mark.real_redis
@pytest.mark.slow
def test_a_chat_named_by_x_session_id_takes_a_message_that_has_a_user_field(
    stack: Stack,
) -> None:
    """Attack (no malice needed): a chat made and used on the chat page is continued over
    the OpenAI endpoint by its ``X-Session-Id``, from a client that fills in the request's
    ``user`` field (many OpenAI client libraries and bot frameworks always send it).

    What happened: 400 ``invalid_message`` ("the message's scope does not match its
    session's scope"), every time: with an ``X-Session-Id`` the ``user`` field no longer
    picks the conversation, but it still rewrites the message's scope to
    ``user-<h>-oa-<digest>`` (gateway/openai_compat.py:97-100), which the chat's first
    message fixed as ``user-<h>``. The message is queued, taken by a worker and refused.

    Expected: the conversation named by ``X-Session-Id`` is the one the message runs in
    (README), with that chat's scope: the message is answered (200)."""
    with httpx.Client(timeout=30) as http:
        sid = http.post(f"{stack.a}/api/sessions", json={}, headers=ALICE).json()["id"]
        r = http.post(
            f"{stack.a}/api/sessions/{sid}/messages?wait=20",
            json={"content": "hello from the page"},
            headers=ALICE,
        )
        assert r.status_code == 200, r.text
        assert r.json()["event"]["type"] == "message", r.text
        r = _completion(
            http, stack.a, "and from my bot", user="alice@example.com",
            headers={"X-Session-Id": sid},
        )  # fmt: skip
    assert r.status_code == 200, f"{r.status_code} {r.text}"
