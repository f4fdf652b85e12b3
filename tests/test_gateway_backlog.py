"""What one user may leave waiting for the workers (gateway.backlog), in process (httpx over
ASGI) on fakeredis and on a real redis-server, with no worker running: nothing is consumed,
so without the bound a user could queue until Redis is full for every channel. Also the
races the bound's transaction closes: replicas admitting at once, a message racing a
delete, temporary chats opened at once; and a small connection pool."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from test_gateway_api import ALICE, BOB, TOKENS, _client, _serving

from bus_redis.keys import Keys
from gateway.app import Gateway, create_app
from gateway.auth import User
from gateway.settings import GatewaySettings

pytestmark = pytest.mark.frontend


async def test_what_one_user_leaves_waiting_is_bounded_and_others_are_still_served(
    redis_factory,
) -> None:  # type: ignore[no-untyped-def]
    """No worker runs: nothing is consumed, so without a bound a user could queue until
    Redis is full (for every channel). 3 entries a chat, 2 chats with entries waiting."""
    redis = redis_factory()
    keys = Keys()
    limits = {"max_waiting_per_chat": 3, "max_waiting_chats_per_user": 2}
    async with _client(redis_factory, **limits) as http:

        async def new_chat(who: dict[str, str]) -> str:
            return str((await http.post("/api/sessions", json={}, headers=who)).json()["id"])

        def send(sid: str, who: dict[str, str] = ALICE) -> Any:
            return http.post(f"/api/sessions/{sid}/messages", json={"content": "q"}, headers=who)

        a, b, c = await new_chat(ALICE), await new_chat(ALICE), await new_chat(ALICE)
        assert [(await send(a)).status_code for _ in range(4)] == [202, 202, 202, 429]
        full = await send(a)
        assert "3 messages are waiting in this chat" in full.json()["detail"]
        assert await redis.xlen(keys.inbound(f"web:{a}")) == 3
        # a full chat can still be stopped (twice: then it is full for controls too)
        stops = [(await http.post(f"/api/sessions/{a}/stop", headers=ALICE)).status_code]
        stops += [(await http.post(f"/api/sessions/{a}/stop", headers=ALICE)).status_code]
        stops += [(await http.post(f"/api/sessions/{a}/stop", headers=ALICE)).status_code]
        assert stops == [202, 202, 429]
        assert (await send(b)).status_code == 202
        refused = await send(c)  # a third chat with something waiting: refused
        assert refused.status_code == 429
        assert "waiting in 2 of your chats" in refused.json()["detail"]
        assert await redis.exists(keys.inbound(f"web:{c}")) == 0
        # opening a temporary chat (a control) may use two chats more: then no more
        opened = [
            await http.post("/api/sessions", json={"temporary": True}, headers=ALICE)
            for _ in range(3)
        ]
        assert [r.status_code for r in opened] == [201, 201, 429]
        temporaries = [f"web:{r.json()['id']}" for r in opened[:2]]
        assert len((await http.get("/api/sessions", headers=ALICE)).json()) == 3
        r = await http.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "q"}]},
            headers=ALICE,
        )
        assert r.status_code == 429
        assert r.json()["error"]["type"] == "rate_limit_exceeded"
        # another user of the channel is served meanwhile
        assert (await send(await new_chat(BOB), BOB)).status_code == 202
        # the workers consume chat a and the temporary ones: c may be written to
        await redis.delete(keys.inbound(f"web:{a}"), *(keys.inbound(t) for t in temporaries))
        assert (await send(c)).status_code == 202
        waiting = await redis.zrange(keys.gw_waiting("web", User("alice").hash), 0, -1)
        assert sorted(waiting) == sorted([f"web:{b}", f"web:{c}"])


async def test_concurrent_requests_cannot_all_pass_one_check(redis_factory) -> None:  # type: ignore[no-untyped-def]
    redis = redis_factory()
    limits = {"max_waiting_per_chat": 4, "max_waiting_chats_per_user": 3}
    async with _client(redis_factory, **limits) as http:
        chats = [
            (await http.post("/api/sessions", json={}, headers=ALICE)).json()["id"]
            for _ in range(8)
        ]
        one = f"/api/sessions/{chats[0]}/messages"
        sends = [http.post(one, json={"content": "q"}, headers=ALICE) for _ in range(20)]
        sends += [
            http.post(f"/api/sessions/{sid}/messages", json={"content": "q"}, headers=ALICE)
            for sid in chats[1:]
            for _ in range(3)
        ]
        codes = [r.status_code for r in await asyncio.gather(*sends)]
        lengths = [await redis.xlen(Keys().inbound(f"web:{sid}")) for sid in chats]
        assert sum(1 for n in lengths if n) == 3  # chats with something waiting
        assert max(lengths) == 4
        assert codes.count(202) == sum(lengths)
        assert set(codes) == {202, 429}


async def test_temporary_chats_made_room_for_still_count_while_their_discard_waits(
    redis_factory,
) -> None:  # type: ignore[no-untyped-def]
    """Opening a temporary chat discards the oldest past the limit: the discarded one
    waits for the workers too, so opening and evicting in a loop is bounded as well."""
    limits = {"max_temporary_per_user": 1, "max_waiting_chats_per_user": 1}
    async with _client(redis_factory, **limits) as http:
        # an opening is a control (1 + 2 chats); each evicts the one before, whose
        # discard waits too: the third opening fills the user's room, the fourth is refused
        codes = [
            (await http.post("/api/sessions", json={"temporary": True}, headers=ALICE)).status_code
            for _ in range(4)
        ]
        assert codes == [201, 201, 201, 429]
        redis = redis_factory()
        streams = await redis.keys(Keys().inbound("web:*"))
        assert sorted([await redis.xlen(k) for k in streams]) == [1, 2, 2]  # open (+ discard)
        opened = await redis.zrange(Keys().gw_temporary("web", User("alice").hash), 0, -1)
        assert len(opened) == 1


async def test_replicas_keep_the_bounds_exactly(redis_factory) -> None:  # type: ignore[no-untyped-def]
    """Two replicas (each with its own per-user lock) admitting at the same time: the
    check and the write are one transaction in Redis, so neither bound is overshot, also
    by an interrupt (a marker and the message: two entries)."""
    redis = redis_factory()
    limits = {"max_waiting_per_chat": 4, "max_waiting_chats_per_user": 3}
    async with _client(redis_factory, **limits) as one, _client(redis_factory, **limits) as two:
        chats = [
            (await one.post("/api/sessions", json={}, headers=ALICE)).json()["id"] for _ in range(6)
        ]
        sends = [
            (one, two)[i % 2].post(
                f"/api/sessions/{chats[i % 6]}/messages",
                json={"content": "q", "followup": "interrupt" if i % 3 == 0 else "queue"},
                headers=ALICE,
            )
            for i in range(60)
        ]
        codes = [r.status_code for r in await asyncio.gather(*sends)]
        lengths = [await redis.xlen(Keys().inbound(f"web:{sid}")) for sid in chats]
        assert sum(1 for n in lengths if n) == 3
        assert max(lengths) <= 4
        assert set(codes) == {202, 429}


async def test_a_message_racing_a_delete_never_lands_after_it(redis_factory) -> None:  # type: ignore[no-untyped-def]
    """A send and a delete of the same chat at once, on two replicas: the message is
    either written before the delete marker (and deleted with the chat) or refused as for
    a chat that is gone; no title or message outlives the chat."""
    redis = redis_factory()
    async with _client(redis_factory) as one, _client(redis_factory) as two:
        codes: set[int] = set()
        for _ in range(30):
            sid = (await one.post("/api/sessions", json={}, headers=ALICE)).json()["id"]
            sent, deleted = await asyncio.gather(
                one.post(f"/api/sessions/{sid}/messages", json={"content": "t"}, headers=ALICE),
                two.delete(f"/api/sessions/{sid}", headers=ALICE),
            )
            assert deleted.status_code == 204
            codes.add(sent.status_code)
            entries = [f for _id, f in await redis.xrange(Keys().inbound(f"web:{sid}"))]
            # a chat never used leaves without a marker: then nothing was sent either
            marker = [i for i, f in enumerate(entries) if f.get("control") == "delete"]
            after = entries[marker[0] :] if marker else entries
            assert all("payload" not in f for f in after), entries
            await redis.delete(Keys().inbound(f"web:{sid}"))  # as the workers would
        assert codes <= {202, 404}
        titles = Keys().gw_titles("web", User("alice").hash)
        assert await redis.hlen(titles) == 0
        assert (await one.get("/api/sessions", headers=ALICE)).json() == []


async def test_many_users_writing_at_once_fit_a_small_connection_pool(redis_factory) -> None:  # type: ignore[no-untyped-def]
    """A write holds a pooled connection in WATCH while it checks: its reads must not wait
    for a second one, or writers holding every connection of a bounded pool would wait
    for each other (until the pool's timeout)."""
    base = redis_factory()
    kw = base.connection_pool.connection_kwargs
    redis = base
    if not type(base).__module__.startswith("fakeredis"):  # a pool of 2 (the gateway's is bounded)
        pool = aioredis.BlockingConnectionPool(
            host=kw["host"], port=kw["port"], max_connections=2, timeout=3, decode_responses=True
        )
        redis = aioredis.Redis(connection_pool=pool)
    tokens = {f"token-of-user-{i:03d}": f"user{i}" for i in range(12)}
    config = GatewaySettings(tokens=tokens)
    try:
        async with _serving(Gateway(config, redis, [redis_factory()])) as http:
            auth = [{"Authorization": f"Bearer {t}"} for t in tokens]
            chats = [
                (await http.post("/api/sessions", json={}, headers=h)).json()["id"] for h in auth
            ]
            sends = [
                http.post(f"/api/sessions/{c}/messages", json={"content": "q"}, headers=h)
                for c, h in zip(chats, auth, strict=True)
            ]
            replies = await asyncio.wait_for(asyncio.gather(*sends), timeout=30)
            assert [r.status_code for r in replies] == [202] * len(auth)
    finally:
        if redis is not base:
            await redis.aclose()


async def test_temporary_chats_opened_at_once_on_replicas_keep_the_bound(redis_factory) -> None:  # type: ignore[no-untyped-def]
    """Openings (each evicting an idle temporary chat, whose discard then waits) on four
    replicas at once: the registration, the eviction and its discard are one transaction,
    so the chats with entries waiting stay within 8 + 2, and a refused opening evicts
    nothing."""
    redis = redis_factory()
    k = Keys()
    async with contextlib.AsyncExitStack() as stack:
        replicas = [await stack.enter_async_context(_client(redis_factory)) for _ in range(4)]
        http = replicas[0]
        temporary = [
            (await http.post("/api/sessions", json={"temporary": True}, headers=ALICE)).json()["id"]
            for _ in range(5)
        ]
        await redis.delete(*(k.inbound(f"web:{t}") for t in temporary))  # the workers took them
        for _ in range(6):
            sid = (await http.post("/api/sessions", json={}, headers=ALICE)).json()["id"]
            await http.post(f"/api/sessions/{sid}/messages", json={"content": "q"}, headers=ALICE)
        replies = await asyncio.gather(
            *[r.post("/api/sessions", json={"temporary": True}, headers=ALICE) for r in replicas]
        )
        codes = sorted(r.status_code for r in replies)
        busy = [key for key in await redis.keys(k.inbound("web:*")) if await redis.xlen(key)]
        assert len(busy) <= 8 + 2
        assert codes == [201, 201, 429, 429]
        opened = await redis.zrange(k.gw_temporary("web", User("alice").hash), 0, -1)
        assert len(opened) == 5
        assert set(temporary) - set(opened) == {key.partition("web:")[2] for key in busy} & set(
            temporary
        )  # exactly the evicted ones have a discard waiting


async def test_a_chat_never_used_is_deleted_whatever_is_waiting(redis_factory) -> None:  # type: ignore[no-untyped-def]
    """A delete of a chat nothing was ever sent to writes nothing (no marker for the
    workers): it is never refused, and deleting chats in a loop queues nothing."""
    redis = redis_factory()
    limits = {"max_waiting_per_chat": 1, "max_waiting_chats_per_user": 1}
    async with _client(redis_factory, **limits) as http:

        async def new_chat() -> str:
            return str((await http.post("/api/sessions", json={}, headers=ALICE)).json()["id"])

        used = [await new_chat() for _ in range(3)]
        for sid in used:  # 1 + 2 chats with something waiting: the user's room is full
            r = await http.post(f"/api/sessions/{sid}/stop", headers=ALICE)
            assert r.status_code == 202
        assert (
            await http.post(f"/api/sessions/{await new_chat()}/stop", headers=ALICE)
        ).status_code == 429
        before = await redis.dbsize()
        for _ in range(20):
            assert (
                await http.delete(f"/api/sessions/{await new_chat()}", headers=ALICE)
            ).status_code == 204
        assert await redis.dbsize() == before
        # a used chat's delete writes a marker: within a control's room ...
        assert (await http.delete(f"/api/sessions/{used[0]}", headers=ALICE)).status_code == 204
        assert await redis.xlen(Keys().inbound(f"web:{used[0]}")) == 2
        # ... and past it refused (a chat the workers answered before: it has a history)
        answered = await new_chat()
        await redis.hset(Keys().session(f"web:{answered}"), "count", 2)
        assert (await http.delete(f"/api/sessions/{answered}", headers=ALICE)).status_code == 429


async def test_an_unreachable_redis_is_503_not_500() -> None:
    config = GatewaySettings(tokens=TOKENS)
    down = aioredis.from_url("redis://127.0.0.1:1", socket_connect_timeout=1)
    gw = Gateway(config, down, [down])
    app = create_app(config, gw)
    app.state.gw = gw
    transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 40000))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
        r = await http.get("/api/sessions", headers=ALICE)
        assert r.status_code == 503
        assert r.json() == {"detail": "the message store is unavailable; try again"}
    await down.aclose()
