"""The gateway's head cap and origin check as second readers attacked them: pipelined
requests after a large body (and after a split head) are not refused 431, and the own
page behind a Host-rewriting proxy in token mode can send."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.testclient import TestClient

pytestmark = pytest.mark.frontend


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


def _connection() -> tuple[Any, _Transport]:
    """uvicorn's protocol with the head cap, on a transport that records what it wrote."""
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
    return proto, transport


async def test_a_head_that_keeps_coming_is_refused_431() -> None:
    """The cap itself: a head still incomplete past 64 KiB, over several reads, is
    answered 431 and its connection closed, however it is split."""
    proto, transport = _connection()
    proto.data_received(b"GET /livez HTTP/1.1\r\nHost: gw\r\n")
    for _ in range(40):  # 40 x 4 KiB of one header's value
        if transport.closed:
            break
        proto.data_received(b"X-Pad: " + b"a" * 4096 + b"\r\n")
    assert transport.written.startswith(b"HTTP/1.1 431 ")
    assert transport.closed


async def test_a_pipelined_request_after_a_large_body_is_not_refused_431() -> None:
    """HTTP/1.1 pipelining: one read (asyncio reads up to 256 KiB) holds a POST with a
    100 KiB body and the first line of the next request. BoundedHead adds the whole
    read's length to the *next* head's count (on_message_begin reset it to 0 inside
    super().data_received, then ``_head_bytes += len(data)``), so a 25-byte head is
    answered 431 and the connection closed under the first request, whose answer is
    never written."""
    proto, transport = _connection()
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


async def test_a_pipelined_request_after_a_split_head_and_large_body_is_not_refused() -> None:
    """The first request's head arrives over two reads; the second read completes it,
    holds its 100 KiB body and begins the next request. ``was_in_head`` is True (the
    *first* head was in progress), so the whole read is added to the *next* head's count:
    431 and the connection closed, as before the fix."""
    proto, transport = _connection()
    body = b"x" * 100_000
    proto.data_received(b"POST /api/x HTTP/1.1\r\nHost: gw\r\n")  # read 1: half a head
    rest = b"Content-Length: %d\r\n\r\n" % len(body)
    proto.data_received(rest + body + b"GET /livez HTTP/1.1\r\n")  # read 2
    assert b" 431 " not in transport.written, transport.written[:80]
    assert not transport.closed
    for task in list(proto.tasks):
        task.cancel()
