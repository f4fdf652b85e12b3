"""A hostile third reading of 64680d0..0337dab (private sessions beside a stored one, a
full Redis mid-turn or mid-control, inject duplicates, the gateway's catch-up, payload
limit and Idempotency-Key). Each test fails on 0337dab for the reason its docstring
gives. A full Redis is simulated as in ``test_full_redis_turn_effects.py``: a wrapper
refuses one chosen write (``OutOfMemoryError``, nothing written) until the test lets it
through, so it runs the same on fakeredis and on a real redis-server."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import fakeredis
import redis.asyncio as aioredis
from helpers import answering
from redis.exceptions import OutOfMemoryError
from replies import collect, until
from starlette.testclient import TestClient
from test_private_beside_durable import _private
from test_second_reading_private_and_full_redis import Held, hold_a_private_turn

from bus_redis import FrontendClient, Keys, OutboundMessage
from gateway.app import Gateway, create_app
from gateway.settings import GatewaySettings

K = Keys()
OOM = "command not allowed when used memory > 'maxmemory'."


class FullUntil:
    """Stands in for ``RedisBus.commit``: refuses the commits ``when`` picks as a full
    Redis does (before anything was written) until ``room`` is set."""

    def __init__(self, target: Any, when: Any) -> None:
        self.target, self.when = target, when
        self.room = asyncio.Event()
        self.refused = 0

    async def __call__(self, *args: Any, **kw: Any) -> Any:
        if not self.room.is_set() and self.when(*args, **kw):
            self.refused += 1
            raise OutOfMemoryError(OOM)
        return await self.target(*args, **kw)


# --- 1. a private session opened while Redis is full ------------------------------------


async def test_a_private_session_whose_opening_commit_waits_out_a_full_redis_stays_open(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """ARCHITECTURE ("A full Redis in the middle of a turn or a control"): a fenced write
    Redis refuses for memory is tried again while the lease holds, "no delivery is spent";
    an opening's private mark waits out OOM too. The opening's commit (the one that
    writes the owner record, ``owner_op == 'set'``) is retried by ``while_full``, but
    ``SessionHolder.commit`` calls ``rt.turns.opened(member)`` in its ``finally`` on the
    first refusal: the session no longer counts as opening while its record is not
    written. The owners' renewal (``Maintenance.renew_owned``, every owner tick) then
    finds no record (``owner.lua`` renew returns 0 before any write, so a real full Redis
    answers it), takes the session for lost and forgets it; the retried commit lands
    after (the frontend got its ``opened`` answer) and the next private message is
    answered ``session_not_active``. Correct: a session whose opening commit waits out a
    full Redis is still opening; once Redis has room it is open and answers."""
    loop = make_loop(answering())
    client = FrontendClient(redis)
    full = FullUntil(loop.bus.commit, lambda *a, **kw: a[3].owner_op == "set")
    loop.bus.commit = full  # type: ignore[method-assign]
    key, opened = await client.open_transient("web", "opening", session_key="web:opening")
    await until(lambda: full.refused >= 1, timeout_s=10)  # the opening waits for room
    await loop.maintenance.renew_owned()  # an owners' tick while it waits
    full.room.set()  # Redis has room again
    got = await collect(client, "web", {opened}, timeout_s=10)
    assert [e.type for e in got[opened] if e.is_terminal] == ["message"]
    reply = await client.ask(_private(key, "hello again", "p1"), timeout_s=10)
    assert (reply.type, reply.code) == ("message", None), (
        f"the private session opened while Redis was full was dropped: its next message "
        f"got {reply.code}"
    )


# --- 2. a `new` of a private session reached by the worker it was handed over to -------


async def test_a_new_of_a_private_session_handed_over_at_shutdown_keeps_the_stored_history(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """README: ``new`` "On a private session it is a discard" (the stored session beside
    it is neither folded nor deleted). The second reading's fix remembers it in the
    worker's memory only (``TurnRegistry.ended_by_control``, taken by
    ``SessionHolder.discarded`` at the marker, forgotten by ``SessionHolder._stop``).
    A worker shutting down (a rolling restart) while the private turn runs: the `new`
    cancels the turn (the control ends the private session there), the holder commits
    that answer as its last (``_last_commit``) and releases the lease with the marker
    still queued; the next worker reaches the marker with no owner and no memory of the
    control (per-session mode has no private mark either) and runs it as a durable
    `new`: the stored conversation on the key is summarised into memory and deleted,
    although the user only started afresh in the private chat. Correct: the stored
    session beside the private one is kept."""
    model = Held()
    first = make_loop(model.provider, shutdown_grace_s=60)
    client = FrontendClient(redis)
    await hold_a_private_turn(client, model, "h")
    key = "web:h"
    first.stop()  # a rolling restart: it finishes what it runs, takes nothing new
    await client.new(key)  # the user starts afresh in the private chat
    got = await collect(client, "web", {"p1"}, timeout_s=10)
    assert [e.code for e in got["p1"] if e.is_terminal] == ["cancelled"]
    make_loop(model.provider)  # the worker that takes over

    async def carried_out() -> bool:  # the marker is consumed after its effect
        return not await redis.xlen(K.inbound(key))

    await until(carried_out, timeout_s=20)
    assert await redis.hexists(K.session(key), "meta"), (
        "a new of the private session, reached after a handover, folded and deleted the "
        "stored session beside it"
    )


# --- 3. an Idempotency-Key retry of a streamed completion while it is being answered ----

ALICE = {"Authorization": "Bearer alice-token-123"}


def _default_oa_chat(user: str) -> str:
    import hashlib

    h = hashlib.sha256(user.encode()).hexdigest()[:24]
    return f"{h}-oa-{hashlib.sha256(b'openai|').hexdigest()[:24]}"


def test_a_streamed_completion_sent_again_mid_answer_streams_the_answer_once() -> None:
    """README: an ``Idempotency-Key`` "makes a request sent again (the SDK retries a
    connection a replica's death cut) the same message as before: run once, answered
    with its first answer". A retry that comes while the first answer is being written
    (its first deltas already in the chat's stream, before the retry's cursor) follows
    the answer from the middle: ``_Attempt.add`` takes the first delta it sees (``seq``
    2) as the start of the answer and sends it, and the final ``message`` does not start
    with what was sent, so ``_stream`` sends it whole after it: the client's completion
    reads "world" + "Hello world". Before Idempotency-Key a retry was a new message, so
    it never joined an answer half streamed. Correct: the streamed content is the answer
    ("Hello world"), no piece of it twice nor out of place."""
    server = fakeredis.FakeServer()

    def make() -> fakeredis.FakeAsyncRedis:
        return fakeredis.FakeAsyncRedis(server=server, decode_responses=True)

    settings = GatewaySettings(tokens={"alice-token-123": "alice"}, wait_max_s=1.5)
    gw = Gateway(settings, make(), [make()])
    gw.hub.block_ms = 100
    admin = fakeredis.FakeRedis(server=server, decode_responses=True)
    session = f"web:{_default_oa_chat('alice')}"
    done = threading.Event()

    def add(mid: str, kind: str, content: str, seq: int | None = None) -> None:
        doc = OutboundMessage(
            type=kind, channel="web", chat_id=session.split(":", 1)[1], session_key=session,
            reply_to=mid, content=content, metadata={"seq": seq} if seq else {},
        )  # fmt: skip
        admin.xadd(K.out(session), {"payload": doc.model_dump_json(exclude_none=True)})
        admin.xadd(K.pulse("web"), {"o": K.out(session)})

    def worker() -> None:  # the worker answering the message, as its events come
        deadline = time.monotonic() + 20
        while not done.is_set() and time.monotonic() < deadline:
            entries = admin.xrange(K.inbound(session))
            mid = json.loads(entries[0][1]["payload"])["id"] if entries else ""
            if len(entries) == 1 and not admin.exists(K.out(session)):
                add(mid, "delta", "Hello ", 1)  # the first attempt's connection is cut
            if len(entries) == 2:  # the retry is queued (its cursor taken before)
                add(mid, "delta", "world", 2)
                add(mid, "message", "Hello world")
                return
            time.sleep(0.01)

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    body = {"model": "agent", "messages": [{"role": "user", "content": "say hello"}]}
    headers = {**ALICE, "Idempotency-Key": "req-1"}
    try:
        with TestClient(create_app(settings, gw)) as c:
            first = c.post("/v1/chat/completions", json=body, headers=headers)
            assert first.status_code == 504  # (the client saw no answer: it sends it again)
            again = c.post("/v1/chat/completions", json={**body, "stream": True}, headers=headers)
            assert again.status_code == 200, again.text
    finally:
        done.set()
        thread.join(5)
    text = ""
    for line in again.text.splitlines():
        if line.startswith("data: {"):
            doc = json.loads(line[len("data: ") :])
            assert "error" not in doc, doc
            text += doc["choices"][0]["delta"].get("content") or ""
    assert text == "Hello world", f"the retried completion streamed {text!r}"
