"""A last reading of the ended-events rewrite and the head cap: a deleted session's kept
answers keep their stream's expiry, the newest answers are the ones looked at, and a
pipelined request after a split head and a large body is not refused 431."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from bus_redis.keys import Keys
from bus_redis.schema import OutboundMessage
from bus_redis.scripts import script_source


def _event(kind: str, code: str | None = None, content: str = "") -> str:
    return OutboundMessage(
        type=kind, channel="web", chat_id="d", session_key="web:d", code=code,  # type: ignore[arg-type]
        content=content,
    ).model_dump_json(exclude_none=True)  # fmt: skip


async def _delete(r: Any, out: str, marker: str) -> int:
    keys = Keys().deletion("web:d", "lease:web:d", "")
    assert keys[4] == out
    await r.set("lease:web:d", "tok")
    return int(await r.eval(script_source("delete"), len(keys), *keys, "tok", "web:d", marker))


# --------------------------------------------------------------------------------------
# delete.lua / _events.lua: the rewrite (DEL + XADD) drops the events stream's TTL
# --------------------------------------------------------------------------------------


async def test_a_delete_that_keeps_cancelled_answers_keeps_the_streams_ttl(redis) -> None:  # type: ignore[no-untyped-def]
    """Before, XTRIM MINID kept the stream (and its PEXPIRE, AGENT_REPLY_TTL_MS). Now
    keep_error_events DELs it and re-XADDs the kept error answers: the stream has no TTL
    and, with no later message on the chat, is kept for ever (and the gateway's chat,
    which leaves a user's list only "with no events", never does)."""
    r = redis
    out = Keys().out("web:d")
    await r.xadd(out, {"payload": _event("delta", content="secret")})
    marker = await r.xadd("some:inbound", {"control": "delete"})
    await r.xadd(out, {"payload": _event("error", "cancelled")})
    await r.pexpire(out, 3_600_000)
    await _delete(r, out, marker)
    assert await r.xlen(out) == 1  # the cancelled answer stays
    assert await r.pttl(out) > 0, "the kept events stream no longer expires"


# --------------------------------------------------------------------------------------
# _events.lua: XRANGE <from> + COUNT 1000 reads the OLDEST entries; MAXLEN is '~'
# --------------------------------------------------------------------------------------


async def test_a_delete_keeps_the_cancelled_answer_after_many_deltas(redis) -> None:  # type: ignore[no-untyped-def]
    """The stream is capped with MAXLEN ~ 1000 (approximate: it can hold more). When
    more than 1,000 entries follow the marker (the cancelled turn's deltas), the newest
    ones, the cancelled answers, are beyond the COUNT and are dropped (before: XTRIM MINID
    kept everything after the marker)."""
    r = redis
    out = Keys().out("web:d")
    marker = await r.xadd("some:inbound", {"control": "delete"})
    for _ in range(1001):
        await r.xadd(out, {"payload": _event("delta", content="x")})
    await r.xadd(out, {"payload": _event("error", "cancelled")})
    await _delete(r, out, marker)
    left = [f["payload"] for _, f in await r.xrange(out)] if await r.exists(out) else []
    assert any('"cancelled"' in p for p in left), "the cancelled answer was dropped"


# --------------------------------------------------------------------------------------
# gateway/httphead.py: the fix counts a read that *completes* a head and begins the next
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
async def test_a_pipelined_request_after_a_split_head_and_large_body_is_not_refused() -> None:
    """The first request's head arrives over two reads; the second read completes it,
    holds its 100 KiB body and begins the next request. ``was_in_head`` is True (the
    *first* head was in progress), so the whole read is added to the *next* head's count:
    431 and the connection closed, as before the fix."""
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
    proto.data_received(b"POST /api/x HTTP/1.1\r\nHost: gw\r\n")  # read 1: half a head
    rest = b"Content-Length: %d\r\n\r\n" % len(body)
    proto.data_received(rest + body + b"GET /livez HTTP/1.1\r\n")  # read 2
    assert b" 431 " not in transport.written, transport.written[:80]
    assert not transport.closed
    for task in list(proto.tasks):
        task.cancel()
