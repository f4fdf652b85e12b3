"""A second reader's findings on the hostile reviews' fixes to ended events: a deleted
conversation's text left in its events, metadata passing for an error event."""

from __future__ import annotations

import asyncio
import json

from test_wire_as_documented import REAL, Raw, last_reply_is, model_loop, wait_for

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
