"""How often one user may ask a replica (gateway.ratelimit): the bucket itself, the
routes in process (httpx over ASGI, fakeredis and a real redis-server), and the
WebSocket on a real gateway process. A refused request does no Redis work, and another
user is served meanwhile. Also /readyz, which anyone may ask: Redis is asked at most
once a second."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from hypothesis import given, settings
from hypothesis import strategies as st
from replies import until
from test_gateway_api import ALICE, BOB, TOKENS, _never_answering, _serving

from bus_redis.keys import Keys
from gateway.app import Gateway
from gateway.auth import User
from gateway.ratelimit import UserRate
from gateway.settings import GatewaySettings

pytestmark = pytest.mark.frontend


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        """Recorded, not slept, and the clock does not move (the test moves it)."""
        self.slept.append(seconds)
        await asyncio.sleep(0)


def test_a_bucket_admits_its_burst_then_its_rate_then_refuses() -> None:
    clock = Clock()
    rate = UserRate(2, 3, clock=clock, max_delay_s=1)
    assert [rate.admit("a") for _ in range(3)] == [0, 0, 0]
    # no token now: the next comes in half a second, the one after in a second (reserved)
    assert rate.admit("a") == pytest.approx(0.5)
    assert rate.admit("a") == pytest.approx(1.0)
    assert rate.admit("a") is None  # further off than max_delay_s: refused
    assert rate.retry_after_s("a") == pytest.approx(1.5)
    assert rate.admit("b") == 0  # another user's bucket is its own
    clock.now += 1.5  # the two reserved tokens came, and one more
    assert rate.admit("a") == 0
    assert rate.admit("a") == pytest.approx(0.5)
    clock.now += 60  # refilled to the burst, not past it
    assert [rate.admit("a") == 0 for _ in range(4)] == [True, True, True, False]
    assert UserRate(0, 1, clock=clock).admit("a") == 0  # rate 0: no limit


def test_a_costly_request_takes_its_tokens_never_more_than_the_burst() -> None:
    clock = Clock()
    rate = UserRate(10, 20, clock=clock, max_delay_s=1)
    assert rate.admit("a", 17) == 0  # a 1 MiB body: 3 tokens left
    assert rate.admit("a", 17) is None  # 1.4 s off: refused, nothing reserved
    assert rate.admit("a", 3) == 0
    assert rate.admit("a", 5) == pytest.approx(0.5)  # reserved: 0.5 s of refill
    small = UserRate(1, 5, clock=clock, max_delay_s=1)
    assert small.admit("b", 17) == 0  # never more than the burst: else never admitted


async def test_a_request_waits_for_its_token_or_for_the_refusal() -> None:
    clock = Clock()
    rate = UserRate(1, 1, clock=clock, sleep=clock.sleep, max_delay_s=1)
    assert await rate.wait("a") is True  # the burst
    assert await rate.wait("a") is True  # waited a second for the next token
    assert await rate.wait("a") is False  # two seconds off: refused, after half to a second
    assert clock.slept[0] == 1.0
    assert 0.5 <= clock.slept[1] <= 1.0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.floats(0, 0.3)), max_size=300))
def test_no_user_gets_more_than_burst_plus_rate_times_elapsed(
    asks: list[tuple[int, float]],
) -> None:
    """Admissions are counted at the time their token is there (now + the delay)."""
    clock = Clock()
    rate, start = UserRate(5, 4, clock=clock, max_delay_s=0.5), clock.now
    admitted: list[list[float]] = [[], [], [], []]
    for user, dt in asks:
        clock.now += dt
        delay = rate.admit(str(user))
        if delay is not None:
            assert 0 <= delay <= 0.5
            admitted[user].append(clock.now + delay)
    for times in admitted:
        for k, at in enumerate(sorted(times), start=1):
            assert k <= 4 + 5 * (at - start) + 1e-6


def test_memory_is_bounded_and_a_flooder_never_gets_a_fresh_bucket() -> None:
    """100,000 users through a replica keep at most max_users buckets; a user refused all
    along stays refused (the least recently used buckets go first, the refilled ones
    before them)."""
    clock = Clock()
    rate = UserRate(1, 5, clock=clock, max_users=1000, max_delay_s=1)
    admitted = 0
    for i in range(100_000):
        assert rate.admit(f"user{i}") == 0
        admitted += rate.admit("flooder") is not None
        clock.now += 0.0001  # 10 s in all: the flooder earns 10 tokens, asks 100,000 times
        assert len(rate) <= 1000
    assert admitted <= 5 + 10 + 1  # its burst, what 10 s earned, one reserved ahead


@contextlib.asynccontextmanager
async def _gateway(make: Any, **settings: Any) -> AsyncIterator[tuple[httpx.AsyncClient, Gateway]]:
    gw = Gateway(GatewaySettings(**{"tokens": TOKENS, **settings}), make(), [make(), make()])
    async with _serving(gw) as http:
        yield http, gw


async def test_a_user_past_the_rate_waits_or_gets_429_before_any_redis_work(
    redis_factory,
) -> None:  # type: ignore[no-untyped-def]
    """Rate 1, burst 3: past the burst a request waits for the next token (up to a second)
    or, when that is further off, gets 429 after a second; nothing reaches Redis before.
    Another user is served meanwhile, without waiting."""
    redis = redis_factory()
    async with _gateway(redis_factory, user_rate=1, user_burst=3) as (http, gw):
        clock = Clock()
        gw.auth.rate.clock, gw.auth.rate.sleep = clock, clock.sleep  # type: ignore[method-assign]
        sid = (await http.post("/api/sessions", json={}, headers=ALICE)).json()["id"]

        def send() -> Any:
            return http.post(f"/api/sessions/{sid}/messages", json={"content": "q"}, headers=ALICE)

        assert [(await send()).status_code for _ in range(2)] == [202, 202]
        assert clock.slept == []
        answers = await asyncio.gather(send(), send(), send())
        assert sorted(r.status_code for r in answers) == [202, 429, 429]
        # one waited a second for its token, two half a second to a second for nothing
        assert sorted(clock.slept)[-1] == 1.0
        assert all(0.5 <= t <= 1.0 for t in clock.slept)
        assert len(clock.slept) == 3
        refused = next(r for r in answers if r.status_code == 429)
        assert (
            refused.headers["retry-after"] == "2"
        )  # the next free token: the reserved one's after
        assert "too many requests" in refused.json()["detail"]
        inbound = Keys().inbound(f"web:{sid}")
        assert await redis.xlen(inbound) == 3  # the refused messages were never sent
        # every route counts, the OpenAI-compatible one and reads included
        completion = await http.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "q"}]},
            headers=ALICE,
        )  # fmt: skip
        assert completion.status_code == 429
        assert (await http.get("/api/sessions", headers=ALICE)).status_code == 429
        # charged before the body is read or the route found: no instant 422 or 404 either,
        # and the connection is closed (requests pipelined behind it go with it)
        junk = await http.post(
            f"/api/sessions/{sid}/messages", content=b"{not json",
            headers={**ALICE, "Content-Type": "application/json"},
        )  # fmt: skip
        nowhere = await http.get("/api/nowhere", headers=ALICE)
        assert (junk.status_code, nowhere.status_code) == (429, 429)
        assert refused.headers["connection"] == "close"
        # another user of the replica is served meanwhile, at once
        clock.slept.clear()
        bob = (await http.post("/api/sessions", json={}, headers=BOB)).json()["id"]
        r = await http.post(f"/api/sessions/{bob}/messages", json={"content": "q"}, headers=BOB)
        assert r.status_code == 202
        assert clock.slept == []
        clock.now += 2  # the reserved token was used; one more came
        assert (await send()).status_code == 202
        assert clock.slept == []
        assert await redis.xlen(inbound) == 4
        # a request without credentials is 401, as before, and takes no one's token
        assert (await http.get("/api/sessions")).status_code == 401


async def test_a_large_body_costs_a_token_for_each_64_kib_sent_whole_or_in_chunks(
    redis_factory,
) -> None:  # type: ignore[no-untyped-def]
    """Parsing a body costs the event loop in proportion to its size: a rate counted in
    requests let one user keep a replica's core busy with 1 MiB bodies (a helper's attack,
    stop 52). A body costs a token more per 64 KiB: by its Content-Length before it is
    read, or, sent in chunks without one, once it has been read (before any parsing)."""
    async with _gateway(redis_factory, user_rate=1, user_burst=12) as (http, gw):
        clock = Clock()
        gw.auth.rate.clock, gw.auth.rate.sleep = clock, clock.sleep  # type: ignore[method-assign]
        sid = (await http.post("/api/sessions", json={}, headers=ALICE)).json()["id"]
        body = json.dumps({"content": "q", "metadata": {"pad": "x" * (200 << 10)}}).encode()

        def left() -> float:  # Alice's tokens (the clock stands still: no refill)
            [(tokens, _)] = gw.auth.rate._buckets.values()
            return tokens

        before = left()
        r = await http.post(f"/api/sessions/{sid}/messages", content=body,
                            headers={**ALICE, "Content-Type": "application/json"})  # fmt: skip
        assert r.status_code == 202, r.text
        assert before - left() == 1 + len(body) // (64 << 10)  # 4 tokens

        async def chunks() -> AsyncIterator[bytes]:
            for at in range(0, len(body), 50_000):
                yield body[at : at + 50_000]

        before = left()
        r = await http.post(f"/api/sessions/{sid}/messages", content=chunks(),
                            headers={**ALICE, "Content-Type": "application/json"})  # fmt: skip
        assert r.status_code == 202, r.text
        assert before - left() == 1 + len(body) // (64 << 10)
        # past the bucket: refused before the body is parsed, nothing sent
        before_len = await redis_factory().xlen(Keys().inbound(f"web:{sid}"))
        headers = {**ALICE, "Content-Type": "application/json"}
        answers = [
            await http.post(f"/api/sessions/{sid}/messages", content=body, headers=headers)
            for _ in range(3)
        ]
        assert 429 in [a.status_code for a in answers]
        sent = await redis_factory().xlen(Keys().inbound(f"web:{sid}")) - before_len
        assert sent == sum(a.status_code == 202 for a in answers)


async def test_many_requests_at_once_admit_the_burst_and_what_comes_within_a_second(
    redis_factory,
) -> None:  # type: ignore[no-untyped-def]
    async with _gateway(redis_factory, user_rate=1, user_burst=10) as (http, gw):
        clock = Clock()
        gw.auth.rate.clock, gw.auth.rate.sleep = clock, clock.sleep  # type: ignore[method-assign]
        answers = await asyncio.gather(
            *(http.get("/api/sessions", headers=ALICE) for _ in range(50))
        )
        assert sorted(r.status_code for r in answers) == [200] * 11 + [429] * 39


@pytest.mark.real_redis
@pytest.mark.slow
async def test_websocket_subscriptions_count_and_a_connection_past_the_rate_is_closed() -> None:
    from stacks import ALICE as ALICE_GW
    from stacks import BOB as BOB_GW
    from stacks import running_stack
    from websockets.asyncio.client import connect

    # a token per 100 s: none comes back while the test runs
    env = {"AGENT_GATEWAY_USER_RATE": "0.01", "AGENT_GATEWAY_USER_BURST": "4"}
    with running_stack(gateways=1, workers=0, gateway_env=env) as stack:
        async with httpx.AsyncClient(timeout=30) as http:
            sid = (await http.post(f"{stack.a}/api/sessions", json={}, headers=ALICE_GW)).json()[
                "id"
            ]  # 1
            ticket = (await http.post(f"{stack.a}/api/tickets", headers=ALICE_GW)).json()[
                "ticket"
            ]  # 2
            url = stack.a.replace("http://", "ws://") + "/api/ws"
            async with connect(f"{url}?ticket={ticket}") as ws:  # 3
                await ws.send(json.dumps({"op": "subscribe", "session_id": sid}))  # 4
                assert json.loads(await asyncio.wait_for(ws.recv(), 20))["type"] == "subscribed"
                await ws.send(json.dumps({"op": "subscribe", "session_id": sid}))
                frame = json.loads(await asyncio.wait_for(ws.recv(), 20))
                assert frame["type"] == "error"
                assert "too many requests" in frame["message"]
                # the socket stays open for what it follows; another user is served
                r = await http.post(f"{stack.a}/api/sessions", json={}, headers=BOB_GW)
                assert r.status_code == 201
            assert await _closed_at_once(url, ALICE_GW) == (4429, "too many requests")


async def test_readyz_asks_redis_at_most_once_a_second_however_often_it_is_asked(
    redis_factory,
) -> None:  # type: ignore[no-untyped-def]
    """/readyz needs no credentials: 200 callers at once share one PING, and an answer is
    reused for a second; a Redis that cannot be reached is 503 (and asked again later)."""
    async with _gateway(redis_factory) as (http, gw):
        clock = gw.readiness.clock = Clock()  # type: ignore[assignment]
        answers = await asyncio.gather(*(http.get("/readyz") for _ in range(200)))
        assert {r.status_code for r in answers} == {200}
        assert gw.readiness.pings == 1
        assert (await http.get("/readyz")).status_code == 200
        assert gw.readiness.pings == 1
        clock.now += 1
        gone = aioredis.from_url("redis://127.0.0.1:1/0")  # nothing listens there
        gw.readiness.redis = gone
        try:
            assert (await http.get("/readyz")).status_code == 503
            assert (await http.get("/readyz")).status_code == 503
            assert gw.readiness.pings == 2
        finally:
            await gone.aclose()


async def test_a_ping_redis_never_answers_is_given_up_and_the_next_one_is_sent(
    redis_factory, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """A PING on a connection whose peer went silent (a failover, a dropped flow) must not
    hold every later /readyz: it is given up after PING_TIMEOUT_S (not ready), and once the
    answer is a second old the next caller pings again."""
    import gateway.health
    from gateway.health import Readiness

    monkeypatch.setattr(gateway.health, "PING_TIMEOUT_S", 0.2)
    clock = Clock()
    async with _never_answering() as frozen:
        readiness = Readiness(frozen, clock=clock)
        # (held for ever without the timeout: a failure here, not a hung suite)
        assert await asyncio.wait_for(readiness.ready(), 5) is False
        assert await asyncio.wait_for(readiness.ready(), 5) is False  # the answer reused
        assert readiness.pings == 1
        readiness.redis = redis_factory()  # Redis is back (another server answers)
        clock.now += 1
        assert await asyncio.wait_for(readiness.ready(), 5) is True
        assert readiness.pings == 2


def test_the_rate_settings_at_their_edges() -> None:
    from pydantic import ValidationError

    for bad in ("1e-300", "inf", "nan", "-1", "0.0001"):
        with pytest.raises(ValidationError):
            GatewaySettings(user_rate=bad)
    assert GatewaySettings(user_rate=0).user_rate == 0  # no limit
    # a clock stepped back, then forward again, gives no refill for the time it went back
    clock = Clock()
    rate = UserRate(1, 2, clock=clock)
    assert [rate.admit("a"), rate.admit("a")] == [0, 0]
    clock.now -= 100
    assert rate.admit("a") == pytest.approx(1.0)  # nothing came back
    clock.now += 100
    assert rate.admit("a") is None  # the reserved token is not there yet: no free refill


@pytest.mark.real_redis
@pytest.mark.slow
async def test_a_socket_flooding_pings_is_dropped_and_others_are_served() -> None:
    """uvicorn answers pings below the app (no token is taken for them): a socket sending
    more than 20 control frames a second is dropped by the gateway's protocol
    (gateway.wscontrol); a socket pinging now and then stays."""
    from stacks import ALICE as ALICE_GW
    from stacks import BOB as BOB_GW
    from stacks import running_stack
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    with running_stack(gateways=1, workers=0) as stack:
        url = stack.a.replace("http://", "ws://") + "/api/ws"
        async with connect(url, additional_headers=ALICE_GW, ping_interval=None) as calm:
            for _ in range(3):  # a client's keep-alive pings: answered
                await asyncio.wait_for(await calm.ping(), 10)

            async def flood(ws: Any) -> None:
                for _ in range(10_000):  # (answered for ever without the cap)
                    await ws.ping()
                await asyncio.wait_for(ws.recv(), 10)

            async with connect(url, additional_headers=ALICE_GW, ping_interval=None) as ws:
                with pytest.raises(ConnectionClosed):
                    await flood(ws)
            await asyncio.wait_for(await calm.ping(), 10)  # the calm one is still there
            async with httpx.AsyncClient(timeout=30) as http:
                r = await http.get(f"{stack.a}/api/sessions", headers=BOB_GW)
                assert r.status_code == 200


@pytest.mark.real_redis
@pytest.mark.slow
async def test_a_user_holds_at_most_the_sockets_allowed_and_gets_one_back_when_one_closes() -> None:
    """Idle WebSockets subscribe nothing, so the streams' bound does not hold them: a user
    keeps at most AGENT_GATEWAY_MAX_SOCKETS_PER_USER open on one replica (the next is
    closed 4429), another user is not refused, and a closed socket frees its place."""
    from stacks import ALICE as ALICE_GW
    from stacks import BOB as BOB_GW
    from stacks import running_stack
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    env = {"AGENT_GATEWAY_MAX_SOCKETS_PER_USER": "3"}
    with running_stack(gateways=1, workers=0, gateway_env=env) as stack:
        url = stack.a.replace("http://", "ws://") + "/api/ws"
        async with contextlib.AsyncExitStack() as held:
            sockets = [
                await held.enter_async_context(connect(url, additional_headers=ALICE_GW))
                for _ in range(3)
            ]
            refused = await _closed_at_once(url, ALICE_GW)
            assert refused == (4429, "too many connections for this user")
            async with connect(url, additional_headers=BOB_GW) as bob:  # served
                await bob.send(json.dumps({"op": "subscribe", "session_id": "x"}))
                frame = json.loads(await asyncio.wait_for(bob.recv(), 20))
                assert frame["type"] == "error"  # (answered: no such chat)
            await sockets[0].close()
            await sockets[0].wait_closed()

            async def again() -> bool:  # the server side of the closed one ends, then room
                try:
                    async with connect(url, additional_headers=ALICE_GW) as ws:
                        await ws.send(json.dumps({"op": "subscribe", "session_id": "x"}))
                        await asyncio.wait_for(ws.recv(), 20)
                        return True
                except ConnectionClosed:
                    return False

            await until(again, timeout_s=20)


async def test_a_wait_on_a_temporary_chat_ends_at_its_loss_notice(redis_factory) -> None:  # type: ignore[no-untyped-def]
    """``?wait=`` on a temporary chat: the private session's worker died, its unread
    answer went with the session's events; the unsolicited ``session_lost`` ends the wait
    (it was a 504 after the whole wait)."""
    from bus_redis import OutboundMessage

    async with _gateway(redis_factory) as (_http, gw):
        user = User("alice")
        chat = gw.chats.mint_temporary(user)
        out = gw.keys.out(chat.session_key)
        after = await gw.hub.last_id(out)
        notice = OutboundMessage(
            type="error", channel="web", chat_id=chat.id, session_key=chat.session_key,
            code="session_lost", content="the private session is gone",
        )  # fmt: skip
        waiting = asyncio.create_task(gw.wait_terminal(user, chat, {"m1"}, after, 30))
        await gw.redis.xadd(out, {"payload": notice.model_dump_json(exclude_none=True)})
        got = await asyncio.wait_for(waiting, 20)
        assert got is not None
        assert got.code == "session_lost"


async def _closed_at_once(url: str, headers: dict[str, str]) -> tuple[int, str]:
    """The close code and reason of a WebSocket the gateway closes before any frame."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    with pytest.raises(ConnectionClosed) as closed:
        async with connect(url, additional_headers=headers) as ws:
            await asyncio.wait_for(ws.recv(), 20)
    assert closed.value.rcvd is not None
    return closed.value.rcvd.code, closed.value.rcvd.reason
