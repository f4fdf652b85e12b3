"""A hostile second reading of 64680d0..2149daa (private sessions beside a stored one,
``backoff.while_full``, inject duplicates, the gateway's catch-up and payload limit).
Each test fails on 2149daa for the reason its docstring gives. A fourth finding (a
stored chat's schedule firing into a private session in single-owner mode) is tested
in ``test_private_beside_durable.py``, in both modes."""

from __future__ import annotations

import asyncio
from typing import Any

import fakeredis
import pytest
import redis.asyncio as aioredis
from helpers import ScriptedProvider, answering
from redis.exceptions import OutOfMemoryError
from replies import collect, open_private, until
from starlette.testclient import TestClient
from test_private_beside_durable import SUMMARY, _durable, _private

from bus_redis import (
    FrontendClient,
    InboundMessage,
    Keys,
    MessageRejectedError,
    RedisBus,
    decode_inbound,
)
from gateway.app import Gateway, create_app
from gateway.settings import GatewaySettings
from session_store.redis_store import RedisSessionStore
from worker import AgentLoop, LoopConfig
from worker.agent.providers import LLMResponse

K = Keys()


class Held:
    """A model that summarises at once, answers "ok", and holds a call whose last user
    message is ``HOLD`` until ``go`` is set (``entered`` tells it is there)."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.go = asyncio.Event()
        self.provider = ScriptedProvider(handler=self.answer)

    async def answer(self, **call: Any) -> LLMResponse:
        if str(call["messages"][0]["content"]).startswith("Summarise"):
            return LLMResponse(content=SUMMARY)
        last = call["messages"][-1]
        if last.get("role") == "user" and "HOLD" in str(last.get("content")):
            self.entered.set()
            await self.go.wait()
        return LLMResponse(content="ok")


# --- 1. a `new` of the private session while its turn runs ------------------------------


async def hold_a_private_turn(client: FrontendClient, model: Held, chat: str) -> str:
    """Two answered durable turns in ``web:<chat>``, then a private session opened on the
    same key whose turn ("p1") is held in the model; the key."""
    for i in range(2):
        reply = await client.ask(_durable(chat, f"durable turn {i}", f"d{i}"), timeout_s=10)
        assert reply.type == "message"
    key = await open_private(client, chat)
    await client.send(_private(key, "HOLD on", "p1"))
    await asyncio.wait_for(model.entered.wait(), 10)  # the private turn runs
    return key


async def test_a_new_of_a_private_session_while_its_turn_runs_keeps_the_stored_history(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """README: ``new`` "On a private session it is a discard" (the stored session beside
    it is not folded nor deleted); the change says a discard or new of the private
    session itself only ends it. ``ControlRouter._apply`` (the pub/sub control that
    cancels the running private turn) already disowns the private session, so when the
    holder reaches the marker ``SessionHolder.discarded`` finds ``owned is None`` and
    treats the ``new`` as a durable one: the stored conversation on the key is summarised
    into memory and deleted, although the user only started afresh in the private chat."""
    model = Held()
    loop = make_loop(model.provider)
    client = FrontendClient(redis)
    key = await hold_a_private_turn(client, model, "n")
    await client.new(key)
    got = await collect(client, "web", {"p1"}, timeout_s=10)
    assert [e.code for e in got["p1"] if e.is_terminal] == ["cancelled"]

    async def carried_out() -> bool:  # the marker is consumed after its effect
        return key not in loop.turns.owned() and not await redis.xlen(K.inbound(key))

    await until(carried_out, timeout_s=10)
    assert await redis.hexists(K.session(key), "meta"), (
        "a new of the private session folded and deleted the stored session beside it"
    )


# --- 2. the gateway's payload limit measures another message than it sends -------------

ALICE = {"Authorization": "Bearer alice-token-123"}
LIMIT = 1024


def test_a_message_the_gateway_accepts_is_within_the_workers_payload_limit() -> None:
    """README: ``AGENT_GATEWAY_MAX_PAYLOAD_BYTES`` bounds "a message as published (its
    text, metadata and envelope as JSON); more: 413, nothing sent (the workers would
    answer ``too_large``)". ``Gateway.publish`` measures ``msg`` before
    ``FrontendClient.send_entry`` adds the deployment's default ``followup``
    (``AGENT_GATEWAY_FOLLOWUP``) to it: with a default set, a message up to
    ``len(',"followup":"queue"')`` bytes under the limit as measured is accepted (202),
    published over the limit, and refused ``too_large`` (dead-lettered) by the workers."""
    server = fakeredis.FakeServer()

    def make() -> fakeredis.FakeAsyncRedis:
        return fakeredis.FakeAsyncRedis(server=server, decode_responses=True)

    settings = GatewaySettings(
        tokens={"alice-token-123": "alice"}, followup="queue", max_payload_bytes=LIMIT
    )
    gw = Gateway(settings, make(), [make()])
    gw.hub.block_ms = 100
    admin = fakeredis.FakeRedis(server=server, decode_responses=True)
    with TestClient(create_app(settings, gw)) as c:
        sid = c.post("/api/sessions", json={}, headers=ALICE).json()["id"]
        send = f"/api/sessions/{sid}/messages"
        assert (
            c.post(send, json={"content": "x", "client_id": "c1"}, headers=ALICE).status_code == 202
        )
        [(_eid, fields)] = admin.xrange(K.inbound(f"web:{sid}"))
        as_measured = InboundMessage.model_validate_json(fields["payload"]).model_copy(
            update={"followup": None}
        )
        base = len(as_measured.model_dump_json(exclude_none=True).encode()) - 1
        content = "y" * (LIMIT - base)  # exactly the limit, as the gateway measures it
        r = c.post(send, json={"content": content, "client_id": "c2"}, headers=ALICE)
        if r.status_code == 413:
            return  # refused: nothing sent (what the README promises)
        assert r.status_code == 202, r.text
        raw = admin.xrange(K.inbound(f"web:{sid}"))[-1][1]["payload"]
        try:
            decode_inbound(raw, max_bytes=LIMIT)
        except MessageRejectedError as exc:
            raise AssertionError(
                f"accepted (202) but published {len(raw.encode())} bytes: the workers answer "
                f"{exc.code} (limit {LIMIT})"
            ) from None


# --- 3. shutdown and a delete waiting out a full Redis -----------------------------------


async def test_shutdown_ends_a_delete_waiting_out_a_full_redis_and_releases_its_lease(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, redis_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``AgentLoop._drain``: "Let running sessions finish within the grace period, then
    cancel the rest; their leases are released at once (no other worker waits for a
    TTL)". A ``delete`` (or ``new``) whose fenced delete Redis refuses for memory now
    waits in ``backoff.while_full`` for as long as the lease holds, and nothing in it
    looks at the shutdown: ``holder.abort("shutdown")`` cancels only a running turn, so
    the worker's ``run()`` returns (after the grace and 5 s more) with the holder still
    there, still renewing the session's lease and retrying the write after the worker
    stopped; the lease is never released."""
    tries: list[int] = []
    reached = asyncio.Event()

    async def full(self: RedisSessionStore, *args: Any, **kw: Any) -> int:
        tries.append(1)
        reached.set()
        raise OutOfMemoryError("OOM command not allowed when used memory > 'maxmemory'.")

    config = LoopConfig(read_block_ms=50, shutdown_grace_s=0.2)
    loop = AgentLoop(RedisBus(redis_factory()), answering(), config=config)
    task = asyncio.create_task(loop.run())
    try:
        client = FrontendClient(redis)
        reply = await client.ask(_durable("j", "hello", "m1"), timeout_s=10)
        assert reply.type == "message"
        monkeypatch.setattr(RedisSessionStore, "delete_held", full)
        await client.delete("web:j")
        await asyncio.wait_for(reached.wait(), 10)  # the delete waits for room
        loop.stop()
        await asyncio.wait_for(task, 30)  # the worker's run() is over
        held = list(loop.holders)
        lease = await redis.get(K.lease("web:j"))
        detail = f"its delete tried {len(tries)} times and still trying"
        assert not held, f"the worker stopped with {held} still held ({detail})"
        assert lease is None, f"the worker stopped holding the lease of web:j ({detail})"
    finally:
        loop.stop()
        for serving in list(loop._serving):  # (the holder left behind, if any)
            serving.cancel()
        await asyncio.gather(*loop._serving, return_exceptions=True)
        if not task.done():
            await asyncio.wait_for(task, 30)
        await loop.bus.aclose()  # (what the holder left behind reconnected)
