"""A second reader's findings on the hostile reviews' fixes: a deleted conversation's text
left in its events, metadata passing for an error event, a pipelined request refused 431,
the own page behind a Host-rewriting proxy in token mode."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from starlette.testclient import TestClient
from test_wire_as_documented import REAL, Raw, last_reply_is, model_loop, wait_for

# --------------------------------------------------------------------------------------
# gateway/httphead.py: bytes of the previous request's body are counted as the next head
# --------------------------------------------------------------------------------------


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written = b""
        self.closed = False

    def write(self, data: bytes) -> None:  # type: ignore[override]
        self.written += bytes(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 5555), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


@pytest.mark.frontend
async def test_a_pipelined_request_after_a_large_body_is_not_refused_431() -> None:
    """HTTP/1.1 pipelining: one read (asyncio reads up to 256 KiB) holds a POST with a
    100 KiB body and the first line of the next request. BoundedHead adds the whole
    read's length to the *next* head's count (on_message_begin reset it to 0 inside
    super().data_received, then ``_head_bytes += len(data)``), so a 25-byte head is
    answered 431 and the connection closed under the first request, whose answer is
    never written."""
    import uvicorn
    from uvicorn.server import ServerState

    from gateway.httphead import BoundedHead

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        pass

    config = uvicorn.Config(app, http=BoundedHead, log_level="error", lifespan="off")
    config.load()
    proto = BoundedHead(config, ServerState(), {}, _loop=asyncio.get_running_loop())
    transport = _Transport()
    proto.connection_made(transport)
    body = b"x" * 100_000
    first = b"POST /api/x HTTP/1.1\r\nHost: gw\r\nContent-Length: %d\r\n\r\n" % len(body)
    proto.data_received(first + body + b"GET /livez HTTP/1.1\r\n")  # one read
    assert b" 431 " not in transport.written, transport.written[:80]
    assert not transport.closed
    for task in list(proto.tasks):
        task.cancel()


# --------------------------------------------------------------------------------------
# gateway/origin.py: the gateway's own page behind a proxy that rewrites Host
# --------------------------------------------------------------------------------------


@pytest.mark.frontend
def test_the_own_page_with_a_token_behind_a_host_rewriting_proxy_can_send() -> None:
    """Token mode (no trusted proxy, so no ambient credential a foreign page could use:
    the page sends ``Authorization: Bearer``). Behind nginx's default ``proxy_pass``
    (Host rewritten to the upstream address; X-Forwarded-Host is believed only from a
    trusted proxy, and token mode has none) the page's own POSTs carry
    ``Origin: https://chat.example`` and are all refused 403: the chat page can no longer
    create a chat or send, while the check protects nothing here."""
    import fakeredis

    from gateway.app import Gateway, create_app
    from gateway.settings import GatewaySettings

    server = fakeredis.FakeServer()

    def make() -> fakeredis.FakeAsyncRedis:
        return fakeredis.FakeAsyncRedis(server=server, decode_responses=True)

    settings = GatewaySettings(tokens={"alice-token-123": "alice"})
    app = create_app(settings, Gateway(settings, make(), [make()]))
    with TestClient(app, base_url="http://127.0.0.1:8000") as c:
        r = c.post(
            "/api/sessions",
            json={},
            headers={
                "Authorization": "Bearer alice-token-123",
                "Origin": "https://chat.example",  # the page as the browser loaded it
                "X-Forwarded-Host": "chat.example",
            },
        )
        assert r.status_code < 400, (r.status_code, r.text)


# --------------------------------------------------------------------------------------
# bus_redis/lua/delete.lua: XTRIM MINID <marker> keeps a deleted conversation's text
# --------------------------------------------------------------------------------------


@REAL
async def test_a_delete_leaves_no_text_of_the_deleted_conversation_in_its_events(
    redis_factory, make_loop
) -> None:  # type: ignore[no-untyped-def]
    """README: without the PUBLISH the running turn "ends as it would have" and the marker
    is honoured when reached; a delete removes the session "with its history and events".
    delete.lua now only trims the events older than the marker: the running turn's answer
    (the deleted conversation's own text, written after the marker) stays in
    P:{C}:out:S after its history was deleted (before: DEL took every event)."""
    model, _ = model_loop(make_loop)
    fe = Raw(redis_factory())
    s = "web:delt"
    await fe.send(s, "block secret one", id="a")
    await asyncio.wait_for(model.holding.wait(), 10)
    await fe.control(s, "delete", publish=False)
    await fe.send(s, "after", id="c")
    model.release.set()
    await wait_for(last_reply_is(fe, s, "c"))
    left = [ev for _, ev in await fe.read(s, "0-0", block_ms=1)]
    assert not any("secret" in json.dumps(ev) for ev in left), left


# --------------------------------------------------------------------------------------
# bus_redis/lua/owner_lost.lua: "error" told by a substring anywhere in the payload
# --------------------------------------------------------------------------------------


async def test_a_lost_private_session_keeps_no_answer_text(real_redis) -> None:  # type: ignore[no-untyped-def]
    """owner_lost.lua keeps the entries whose payload *contains* ``"type":"error"``
    anywhere, not those whose type is error. An answer's metadata is the inbound
    message's (the gateway passes a user's metadata, ``_`` keys dropped), so an answer
    (type message, the session's text) to a message with ``{"m":{"type":"error"}}`` in
    its metadata outlives the private session: "none of a private session's text
    outlives it" is broken."""
    from bus_redis.schema import OutboundMessage
    from bus_redis.scripts import script_source

    r = real_redis
    s, out = "web:t-lost", "rv:{web}:out:web:t-lost"
    member = json.dumps([s, "web", "t-lost"])
    answer = OutboundMessage(
        type="message", channel="web", chat_id="t-lost", session_key=s, reply_to="m1",
        content="the private secret answer", metadata={"m": {"type": "error"}},
    ).model_dump_json(exclude_none=True)  # fmt: skip
    await r.xadd(out, {"payload": answer})
    await r.zadd("rv:{web}:owners", {member: 0})
    notice = json.dumps({"v": 2, "type": "error", "code": "session_lost"})
    keys = ["rv:{web}:owner:web:t-lost", "rv:{web}:owners", out, "rv:{web}:ready"]
    keys.append("rv:{web}:pulse")
    args = [member, notice, s, 1000, 60_000]
    assert await r.eval(script_source("owner_lost"), len(keys), *keys, *args) == 1
    left = [f["payload"] for _, f in await r.xrange(out)]
    assert not any("secret" in p for p in left), left
