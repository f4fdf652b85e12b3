"""A last reading of the ended-events rewrite: a deleted session's kept answers keep
their stream's expiry, and the newest answers are the ones looked at."""

from __future__ import annotations

from typing import Any

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
