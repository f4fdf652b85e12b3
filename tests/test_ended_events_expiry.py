"""A last reading of the ended-events rewrite: a deleted session's kept answers keep
their stream's expiry, and the newest answers are the ones looked at."""

from __future__ import annotations

from typing import Any

import pytest

from bus_redis import RedisBus
from bus_redis.keys import Keys
from bus_redis.registry import Registry
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
# delete.lua: the marker's id is of the inbound stream, the events' of the out stream
# --------------------------------------------------------------------------------------


async def test_a_cancelled_answer_of_the_markers_millisecond_stays(redis) -> None:  # type: ignore[no-untyped-def]
    """(Found by tests/test_control_sequences.py.) The ids of two streams share only
    their millisecond: a delete marker queued as the third entry of its millisecond
    (``T-2``) and the cancelled answer written in that same millisecond as the out
    stream's first (``T-0``) compared as earlier, so the answer was deleted and its asker
    waited out its timeout. What was written before the marker in its millisecond and is
    kept with it is an error answer too: no text of the conversation."""
    r = redis
    out = Keys().out("web:d")
    await r.xadd(out, {"payload": _event("message", content="secret")}, id="999-0")
    marker = "1000-2"  # (the inbound stream: two messages, then the marker)
    await r.xadd(out, {"payload": _event("error", "cancelled")}, id="1000-0")
    await r.xadd(out, {"payload": _event("error", "cancelled")}, id="1000-1")
    await _delete(r, out, marker)
    left = [(i, f["payload"]) for i, f in await r.xrange(out)] if await r.exists(out) else []
    assert [i for i, _ in left] == ["1000-0", "1000-1"], left
    assert not any("secret" in p for _, p in left)


# --------------------------------------------------------------------------------------
# owner.lua: a private session's end keeps its error answers, as owner_lost.lua does
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["drop", "abandon"])
async def test_a_private_sessions_end_keeps_the_cancelled_answer_of_its_turn(
    redis, op: str
) -> None:  # type: ignore[no-untyped-def]
    """(Found by tests/test_control_sequences.py.) A discard cuts the running turn of a
    private session over pub/sub and drops its owner record at once, beside the turn's
    commit of its cancelled answer: when the commit landed first, the drop's emptying of
    the events took that answer too, and its asker waited out its timeout. The end keeps
    the error answers now (no text of the conversation), as a lost owner's does."""
    r = redis
    bus = RedisBus(r)
    key = "web:p"
    out = bus.keys.out(key)
    await r.hset(bus.keys.owner(key), mapping={"worker": "w1"})
    await r.xadd(out, {"payload": _event("message", content="secret answer")})
    await r.xadd(out, {"payload": _event("error", "cancelled", "turn cancelled by discard")})
    await r.pexpire(out, 3_600_000)
    registry = Registry(bus)
    if op == "drop":
        await registry.drop_owner(key, "w1", "member")
    else:
        await registry.abandon_owner(key, "w1")
    assert not await r.exists(bus.keys.owner(key))
    left = [f["payload"] for _, f in await r.xrange(out)]
    assert len(left) == 1, left
    assert '"cancelled"' in left[0]
    assert await r.pttl(out) > 0


# --------------------------------------------------------------------------------------
# forgetting.py: unified mode, a `new` of a private key reached by a holder of that key
# --------------------------------------------------------------------------------------


async def test_a_new_of_a_marked_key_under_its_own_lease_is_a_discard(redis) -> None:  # type: ignore[no-untyped-def]
    """(Found by tests/test_control_sequences.py, unified mode.) The worker's note that a
    control ended a private session goes with whichever of its holders stops first (the
    unified holder drains the same stream meanwhile); a holder of the key itself that then
    reached the session's `new` marker took it for a durable `new` on the key: it deleted
    the key's events before the marker, the cancelled answers of the turns the end cut
    among them. A `new` of a key opened private is a discard in unified mode, whoever
    reaches it."""
    from types import SimpleNamespace

    from helpers import ScriptedProvider

    from worker import AgentLoop, LoopConfig
    from worker.runtime.forgetting import forget

    loop = AgentLoop(
        RedisBus(redis), ScriptedProvider(["summary"]), config=LoopConfig(unified_session=True)
    )
    await loop.bus.scripts.load_all()
    key, keys = "web:p", loop.bus.keys
    await redis.set(keys.private_mark(key), "1")  # opened private (the session has ended)
    out = keys.out(key)
    await redis.xadd(out, {"payload": _event("error", "cancelled")}, id="1000-0")
    held = await loop.bus.acquire(key, loop.worker_id, select=False)
    holder = SimpleNamespace(
        rt=loop.rt, key=key, token=held.token, waits=lambda: True, memory_scope="x",
        lease=SimpleNamespace(lost=False),
    )  # fmt: skip
    await forget(holder, key, "new", "1001-0")  # type: ignore[arg-type]
    assert await redis.xlen(out) == 1, "the cancelled answer was deleted"
    assert holder.memory_scope == "x"  # nothing folded
    await loop.bus.aclose()
