"""The gateway's API in process (httpx over ASGI), on fakeredis and on a real redis-server:
default deny, bearer tokens, a trusted proxy's header only from listed addresses,
tickets any replica accepts, ownership, limits and input validation. No worker runs here:
what needs one is in test_gateway_e2e.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from fastapi import HTTPException
from starlette.datastructures import Headers

from bus_redis import OutboundMessage
from bus_redis.keys import Keys
from gateway.app import Gateway, create_app
from gateway.auth import User
from gateway.settings import GatewaySettings

pytestmark = pytest.mark.frontend
ALICE = {"Authorization": "Bearer alice-token-123"}
BOB = {"Authorization": "Bearer bob-token-456"}
TOKENS = {"alice-token-123": "alice", "bob-token-456": "bob"}


@contextlib.asynccontextmanager
async def _client(
    make: Callable[[], aioredis.Redis], *, peer: str = "127.0.0.1", **settings: Any
) -> AsyncIterator[httpx.AsyncClient]:
    config = GatewaySettings(**{"tokens": TOKENS, **settings})
    async with _serving(Gateway(config, make(), [make(), make()]), peer=peer) as http:
        yield http


@contextlib.asynccontextmanager
async def _serving(gw: Gateway, *, peer: str = "127.0.0.1") -> AsyncIterator[httpx.AsyncClient]:
    """``gw``'s app in process (httpx over ASGI), its event hub running."""
    app = create_app(gw.settings, gw)
    gw.hub.start()
    app.state.gw = gw
    transport = httpx.ASGITransport(app=app, client=(peer, 40000))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            yield http
    finally:
        await gw.hub.stop()


@contextlib.asynccontextmanager
async def _never_answering() -> AsyncIterator[aioredis.Redis]:
    """A client of a server that accepts and never answers (a frozen Redis, or a peer
    gone silent)."""
    held: list[asyncio.StreamWriter] = []

    async def never_answer(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    frozen = aioredis.from_url(f"redis://127.0.0.1:{server.sockets[0].getsockname()[1]}")
    try:
        yield frozen
    finally:
        for writer in held:
            writer.close()
        server.close()
        await frozen.aclose()


@contextlib.asynccontextmanager
async def frozen_gateway(timeout_s: float = 0.3) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client of the gateway in process over a Redis that never answers, its
    request deadline ``timeout_s``."""
    config = GatewaySettings(tokens=TOKENS, request_timeout_s=timeout_s)
    async with _never_answering() as frozen:
        gw = Gateway(config, frozen, [frozen])
        app = create_app(config, gw)
        app.state.gw = gw
        transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            yield http


async def test_every_route_refuses_a_caller_without_credentials(redis_factory) -> None:  # type: ignore[no-untyped-def]
    async with _client(redis_factory, tokens={}) as http:  # nothing configured: deny all
        assert (await http.get("/api/sessions", headers=ALICE)).status_code == 401
    async with _client(redis_factory) as http:
        for method, path in [
            ("GET", "/api/me"),
            ("GET", "/api/sessions"),
            ("POST", "/api/sessions"),
            ("POST", "/api/tickets"),
            ("POST", "/v1/chat/completions"),
            ("GET", "/v1/models"),
        ]:
            r = await http.request(method, path, json={})
            assert r.status_code == 401, (method, path)
            assert r.headers.get("www-authenticate") == "Bearer"
        assert (
            await http.get("/api/me", headers={"Authorization": "Bearer alice-token-12"})
        ).status_code == 401
        assert (
            await http.get("/api/me", headers={"Authorization": "Basic alice-token-123"})
        ).status_code == 401
        assert (await http.get("/api/me", headers=ALICE)).json() == {"user": "alice"}
        assert (await http.get("/livez")).status_code == 200
        assert (await http.get("/readyz")).json() == {"ready": True}


async def test_a_proxy_header_is_believed_only_from_a_trusted_address(redis_factory) -> None:  # type: ignore[no-untyped-def]
    header = {"X-Forwarded-User": "carol"}
    async with _client(redis_factory, trusted_proxies=["10.0.0.0/8"], peer="10.1.2.3") as http:
        assert (await http.get("/api/me", headers=header)).json() == {"user": "carol"}
    async with _client(redis_factory, trusted_proxies=["10.0.0.0/8"], peer="192.168.1.9") as http:
        assert (await http.get("/api/me", headers=header)).status_code == 401
        assert (await http.get("/api/me", headers={**header, **ALICE})).json() == {"user": "alice"}


async def test_a_ticket_opens_the_event_streams_only(redis_factory) -> None:  # type: ignore[no-untyped-def]
    async with _client(redis_factory, ticket_ttl_s=30) as one, _client(redis_factory) as two:
        r = await one.post("/api/tickets", headers=ALICE)
        assert r.status_code == 201
        assert r.json()["expires_in_s"] == 30
        ticket = r.json()["ticket"]
        chat = (await one.post("/api/sessions", json={}, headers=ALICE)).json()["id"]
        assert (await two.get(f"/api/me?ticket={ticket}")).status_code == 401
        assert (await two.post("/api/tickets", params={"ticket": ticket})).status_code == 401
        forged = ticket[:-4] + ("AAAA" if not ticket.endswith("AAAA") else "BBBB")
        bad = await two.get(f"/api/sessions/{chat}/events?ticket={forged}")
        assert bad.status_code == 401


def _asking(ticket: str) -> Any:
    """What ``Authenticator.user`` reads of a request: no header, ``?ticket=``."""
    return SimpleNamespace(headers=Headers(), query_params={"ticket": ticket}, client=None)


class _Counting:
    """The ticket key's client, counting the calls made through it."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self.redis, self.calls = redis, 0

    async def set(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return await self.redis.set(*args, **kwargs)


async def test_a_ticket_is_signed_not_stored_and_good_on_any_replica_until_it_expires(
    redis_factory,
) -> None:  # type: ignore[no-untyped-def]
    now = [1_800_000_000.0]
    one = Gateway(GatewaySettings(tokens=TOKENS, ticket_ttl_s=30), redis_factory(), [])
    two = Gateway(GatewaySettings(tokens=TOKENS), redis_factory(), [])
    for gw in (one, two):
        gw.auth.tickets.clock = lambda: now[0]
    redis = redis_factory()
    ticket = await one.auth.mint_ticket(User("alice"))
    assert (await two.auth.user(_asking(ticket), ticket_ok=True)).id == "alice"
    assert (await two.auth.user(_asking(ticket), ticket_ok=True)).id == "alice"  # reusable
    # a user minting in a loop holds no memory: nothing is stored per ticket
    keys = sorted(await redis.keys("*"))
    assert Keys().gw_ticket_secret("web") in keys
    for _ in range(300):
        await one.auth.mint_ticket(User("alice"))
    assert sorted(await redis.keys("*")) == keys
    assert await redis.ttl(Keys().gw_ticket_secret("web")) == -1
    # another user's name under alice's signature, a cut signature: refused
    expiry, _, mac = ticket.split(".")
    for forged in (f"{expiry}.Ym9i.{mac}", ticket[:-1], f"{expiry}.{ticket.split('.')[1]}"):
        with pytest.raises(HTTPException):
            await two.auth.user(_asking(forged), ticket_ok=True)
    now[0] += 31  # past its 30 s
    with pytest.raises(HTTPException):
        await two.auth.user(_asking(ticket), ticket_ok=True)


async def test_forged_tickets_cost_no_redis_call_and_a_new_key_is_picked_up(redis_factory) -> None:  # type: ignore[no-untyped-def]
    now = [1_800_000_000.0]
    one = Gateway(GatewaySettings(tokens=TOKENS), redis_factory(), [])
    two = Gateway(GatewaySettings(tokens=TOKENS), redis_factory(), [])
    for gw in (one, two):
        gw.auth.tickets.clock = lambda: now[0]
    counting = _Counting(two.auth.tickets.redis)
    two.auth.tickets.redis = counting  # type: ignore[assignment]
    good = await one.auth.mint_ticket(User("alice"))
    assert (await two.auth.user(_asking(good), ticket_ok=True)).id == "alice"
    assert counting.calls == 1  # the key, read once
    expiry = good.split(".")[0]
    for i in range(1000):  # well-formed, signed with a key nobody has
        with pytest.raises(HTTPException):
            await two.auth.user(_asking(f"{expiry}.YWxpY2U.{i:022d}"), ticket_ok=True)
    assert counting.calls == 1  # within the second: not even a re-read
    await redis_factory().flushall()  # the key is lost; the next mint makes another
    now[0] += 2
    fresh = await one.auth.mint_ticket(User("alice"))
    assert fresh != good
    assert (await two.auth.user(_asking(fresh), ticket_ok=True)).id == "alice"
    assert counting.calls == 2  # re-read once: another key may have been made
    with pytest.raises(HTTPException):  # signed with the lost key
        await two.auth.user(_asking(good), ticket_ok=True)


async def test_a_ticket_stops_working_with_its_users_token(redis_factory) -> None:  # type: ignore[no-untyped-def]
    one = Gateway(GatewaySettings(tokens=TOKENS), redis_factory(), [])
    ticket = await one.auth.mint_ticket(User("alice"))
    revoked = Gateway(GatewaySettings(tokens={"bob-token-456": "bob"}), redis_factory(), [])
    with pytest.raises(HTTPException):
        await revoked.auth.user(_asking(ticket), ticket_ok=True)
    # behind a trusted proxy users are not listed here: the signature decides
    proxied = GatewaySettings(tokens={}, trusted_proxies=["10.0.0.0/8"])
    behind = Gateway(proxied, redis_factory(), [])
    assert (await behind.auth.user(_asking(ticket), ticket_ok=True)).id == "alice"
    longest = "\U0001f600" * 256  # the longest user id, 4 bytes a character
    ticket = await behind.auth.mint_ticket(User(longest))
    assert (await behind.auth.user(_asking(ticket), ticket_ok=True)).id == longest


def test_the_gateway_log_never_shows_a_ticket() -> None:
    import logging

    from gateway.auth import RedactTickets

    create_app(GatewaySettings(tokens=TOKENS))  # installs the filter on uvicorn's loggers
    logger = logging.getLogger("uvicorn.error")
    assert any(isinstance(f, RedactTickets) for f in logger.filters)
    record = logger.makeRecord(
        "uvicorn.error",
        logging.INFO,
        __file__,
        1,
        '%s - "WebSocket %s" [accepted]',
        ("127.0.0.1:5", "/api/ws?ticket=1a2b.YWxpY2U.secretsecretsecretsecr&x=1"),
        None,
    )
    for f in logger.filters:
        f.filter(record)
    assert record.getMessage() == (
        '127.0.0.1:5 - "WebSocket /api/ws?ticket=[redacted]&x=1" [accepted]'
    )


async def test_ids_are_minted_by_the_server_and_owned_by_their_user(redis_factory) -> None:  # type: ignore[no-untyped-def]
    async with _client(redis_factory, max_sessions_per_user=2) as http:
        r = await http.post("/api/sessions", json={"id": "mine", "title": "T"}, headers=ALICE)
        assert r.status_code == 201
        chat = r.json()
        assert chat["id"] != "mine"
        assert chat["title"] == "T"
        assert chat["temporary"] is False
        assert (await http.post("/api/sessions", json={}, headers=ALICE)).status_code == 201
        full = await http.post("/api/sessions", json={}, headers=ALICE)
        assert full.status_code == 409  # the per-user limit
        assert (await http.post("/api/sessions", json={}, headers=BOB)).status_code == 201
        for sid in [
            chat["id"],
            "web:" + chat["id"],
            chat["id"] + "x",
            "../" + chat["id"],
            "0" * 24 + "-" + "0" * 24,
        ]:
            assert (await http.get(f"/api/sessions/{sid}", headers=BOB)).status_code == 404
        bob_ids = [c["id"] for c in (await http.get("/api/sessions", headers=BOB)).json()]
        assert chat["id"] not in bob_ids
        assert len(bob_ids) == 1


async def test_bad_input_is_refused_with_a_reason(redis_factory) -> None:  # type: ignore[no-untyped-def]
    async with _client(redis_factory) as http:
        sid = (await http.post("/api/sessions", json={}, headers=ALICE)).json()["id"]
        send = f"/api/sessions/{sid}/messages"
        assert (
            await http.post(send, json={"content": "x", "client_id": "a b"}, headers=ALICE)
        ).status_code == 422
        assert (
            await http.post(send, json={"content": "x" * 100_001}, headers=ALICE)
        ).status_code == 422
        assert (await http.post(send, json={}, headers=ALICE)).status_code == 422
        r = await http.get(f"/api/sessions/{sid}/events?after=not-an-id", headers=ALICE)
        assert r.status_code == 400
        r = await http.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "system", "content": "x"}]},
            headers=ALICE,
        )
        assert r.status_code == 400
        assert r.json()["error"]["type"] == "invalid_request_error"
        accepted = await http.post(
            send, json={"content": "queued", "client_id": "c-1"}, headers=ALICE
        )
        assert accepted.status_code == 202  # no worker here: accepted and queued
        assert accepted.json() == {
            "session_id": sid,
            "message_id": "c-1",
            "cursor": "0-0",
            "event": None,
        }
        status = (await http.get(f"/api/sessions/{sid}", headers=ALICE)).json()
        assert status["queued"] == 1
        assert status["state"] == "idle"


async def test_invalid_input_is_refused_without_echoing_it(redis_factory) -> None:  # type: ignore[no-untyped-def]
    """A lone surrogate is valid JSON but no UTF-8: refused (422) like any bad input, in a
    value, and what was sent is never repeated in the answer."""
    async with _client(redis_factory) as http:
        sid = (await http.post("/api/sessions", json={}, headers=ALICE)).json()["id"]
        json_type = {**ALICE, "content-type": "application/json"}
        for path, body in [
            (f"/api/sessions/{sid}/messages", b'{"content": "PRIVATE \\ud800"}'),
            (f"/api/sessions/{sid}/messages", b'{"content": "PRIVATE", "client_id": "a b"}'),
            ("/api/sessions", b'{"title": "t\\ud800"}'),
        ]:
            r = await http.post(path, content=body, headers=json_type)
            assert r.status_code == 422, (path, body)
            assert "PRIVATE" not in r.text
            assert {"type", "loc", "msg"} == set(r.json()["detail"][0])


async def test_the_openapi_schema_describes_the_api(redis_factory) -> None:  # type: ignore[no-untyped-def]
    async with _client(redis_factory) as http:
        doc = (await http.get("/openapi.json")).json()
    paths = set(doc["paths"])
    assert {
        "/api/sessions",
        "/api/sessions/{session_id}",
        "/api/sessions/{session_id}/messages",
        "/api/sessions/{session_id}/events",
        "/api/sessions/{session_id}/stop",
        "/api/sessions/{session_id}/discard",
        "/api/tickets",
        "/v1/chat/completions",
    } <= paths


def test_command_line_options_override_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    from gateway.cli import settings_from

    monkeypatch.setenv("AGENT_REDIS_URL", "redis://env-host:1/0")
    monkeypatch.setenv("AGENT_KEY_PREFIX", "envprefix")
    tokens = tmp_path / "tokens"
    tokens.write_text("# comment\ntok-1 alice\n\ntok-2 bob smith\n")
    monkeypatch.setenv("AGENT_GATEWAY_TOKENS_FILE", str(tokens))
    s = settings_from(["--redis-url", "redis://cli-host:2/0", "--prefix", "cli", "--channel", "tg"])
    assert (s.redis_url, s.key_prefix, s.channel) == ("redis://cli-host:2/0", "cli", "tg")
    assert s.all_tokens() == {"tok-1": "alice", "tok-2": "bob smith"}
    assert settings_from([]).redis_url == "redis://env-host:1/0"
    monkeypatch.setenv("AGENT_GATEWAY_REDIS_URL", "redis://gw-host:3/0")
    assert settings_from([]).redis_url == "redis://gw-host:3/0"
    with pytest.raises(ValueError, match="channel"):
        settings_from(["--channel", "unified"])


async def test_bodies_over_the_limit_are_refused_before_they_are_read(redis_factory) -> None:  # type: ignore[no-untyped-def]
    async with _client(redis_factory, max_body_bytes=4096) as http:
        sid = (await http.post("/api/sessions", json={}, headers=ALICE)).json()["id"]
        big = {"content": "x", "metadata": {"blob": "y" * 10_000}}
        r = await http.post(f"/api/sessions/{sid}/messages", json=big, headers=ALICE)
        assert r.status_code == 413

        async def chunks():  # type: ignore[no-untyped-def]  # no Content-Length: counted
            for _ in range(10):
                yield b"x" * 1000

        r = await http.post("/v1/chat/completions", content=chunks(), headers=ALICE)
        assert r.status_code == 413
        status = (await http.get(f"/api/sessions/{sid}", headers=ALICE)).json()
        assert status["queued"] == 0  # nothing was sent


async def test_a_body_that_stops_coming_is_refused_when_its_time_is_up(redis_factory) -> None:  # type: ignore[no-untyped-def]
    """A client that declares a body and sends part of it (or trickles it) holds nothing
    past ``body_timeout_s``: 408, the connection closed, nothing queued; a whole body in
    time is served as ever."""
    never = asyncio.Event()
    async with _client(redis_factory, body_timeout_s=0.2) as http:
        sid = (await http.post("/api/sessions", json={}, headers=ALICE)).json()["id"]

        async def stalled() -> AsyncIterator[bytes]:
            yield b'{"content": "hal'
            await never.wait()  # the rest never comes
            yield b'f"}'

        for extra in ({}, {"Content-Length": "20"}):  # chunked, or a declared length
            async with asyncio.timeout(10):  # (a gateway that waits on fails here)
                r = await http.post(
                    f"/api/sessions/{sid}/messages",
                    content=stalled(),
                    headers={**ALICE, "content-type": "application/json", **extra},
                )
            assert r.status_code == 408
            assert r.headers["connection"] == "close"
        status = (await http.get(f"/api/sessions/{sid}", headers=ALICE)).json()
        assert status["queued"] == 0
        sent = await http.post(
            f"/api/sessions/{sid}/messages", json={"content": "x"}, headers=ALICE
        )
        assert sent.status_code == 202


async def test_temporary_chats_are_only_those_opened_and_a_few_per_user(redis_factory) -> None:  # type: ignore[no-untyped-def]
    async with _client(redis_factory, max_temporary_per_user=2) as http:
        made = [
            (await http.post("/api/sessions", json={"temporary": True}, headers=ALICE)).json()["id"]
            for _ in range(3)
        ]
        assert (
            await http.get(f"/api/sessions/{made[0]}", headers=ALICE)
        ).status_code == 404  # evicted
        for sid in made[1:]:
            assert (await http.get(f"/api/sessions/{sid}", headers=ALICE)).status_code == 200
        invented = made[1][: -len("0000")] + "0000"
        assert (await http.get(f"/api/sessions/{invented}", headers=ALICE)).status_code == 404
        assert (
            await http.post(f"/api/sessions/{made[1]}/discard", headers=ALICE)
        ).status_code == 202
        assert (await http.get(f"/api/sessions/{made[1]}", headers=ALICE)).status_code == 404
        # the evicted one was discarded on the wire: its stream ends with a discard marker
        redis = redis_factory()
        entries = await redis.xrange(Keys().inbound(f"web:{made[0]}"))
        assert entries[-1][1] == {"control": "discard"}


async def test_concurrent_creations_never_overshoot_the_chat_limit(redis_factory) -> None:  # type: ignore[no-untyped-def]
    import asyncio

    async with _client(redis_factory, max_sessions_per_user=5) as http:
        replies = await asyncio.gather(
            *[http.post("/api/sessions", json={}, headers=ALICE) for _ in range(20)]
        )
        assert sorted(r.status_code for r in replies) == [201] * 5 + [409] * 15
        assert len((await http.get("/api/sessions", headers=ALICE)).json()) == 5


async def test_one_user_cannot_take_every_stream_of_a_replica(redis_factory) -> None:  # type: ignore[no-untyped-def]
    from gateway.auth import User
    from gateway.hub import TooManyStreamsError

    config = GatewaySettings(tokens=TOKENS, max_streams_per_user=2)
    gw = Gateway(config, redis_factory(), [redis_factory()])
    gw.hub.start()
    try:
        bob, alice = User("bob"), User("alice")
        chats = [await gw.chats.create(bob) for _ in range(3)]
        mine = await gw.chats.create(alice)
        async with gw.subscribe(bob, chats[0], "$"), gw.subscribe(bob, chats[1], "$"):
            assert not gw.has_room(bob, chats[2])
            with pytest.raises(TooManyStreamsError):
                async with gw.subscribe(bob, chats[2], "$"):
                    pass
            assert gw.has_room(alice, mine)
            async with gw.subscribe(alice, mine, "$"):
                pass
        assert gw.has_room(bob, chats[2])  # given back when they end
    finally:
        await gw.hub.stop()


async def test_cursors_that_are_no_stream_ids_are_refused(redis_factory) -> None:  # type: ignore[no-untyped-def]
    async with _client(redis_factory) as http:
        sid = (await http.post("/api/sessions", json={}, headers=ALICE)).json()["id"]
        for bad in [
            "18446744073709551616-0",
            "99999999999999999999-0",
            "\u0661\u0662-\u0660",
            "-1-0",
            "abc",
        ]:
            r = await http.get(f"/api/sessions/{sid}/events", params={"after": bad}, headers=ALICE)
            assert r.status_code == 400, bad


async def test_concurrent_temporary_chats_never_leave_one_open_beyond_the_limit(
    redis_factory,
) -> None:  # type: ignore[no-untyped-def]
    """Twenty at once with a limit of 2: every chat that does not stay registered ends with
    a discard after its open on the wire, so no worker keeps it."""
    import asyncio

    limits = {"max_temporary_per_user": 2, "max_waiting_chats_per_user": 100}
    async with _client(redis_factory, **limits) as http:
        replies = await asyncio.gather(
            *[
                http.post("/api/sessions", json={"temporary": True}, headers=ALICE)
                for _ in range(20)
            ]
        )
        kept = [r.json()["id"] for r in replies if r.status_code == 201]
        assert {r.status_code for r in replies} <= {201, 409}
        redis = redis_factory()
        registered = {
            m for m in await redis.zrange(Keys().gw_temporary("web", _alice_hash()), 0, -1)
        }
        assert len(registered) <= 2
        async for key in redis.scan_iter(match="agent:{web}:in:web:*-t-*"):
            entries = [fields for _id, fields in await redis.xrange(key)]
            chat_id = key.split(":in:web:", 1)[1]
            opened = [i for i, f in enumerate(entries) if "open_transient" in f.get("payload", "")]
            discards = [i for i, f in enumerate(entries) if f.get("control") == "discard"]
            if chat_id in registered:
                continue
            assert discards, (chat_id, entries)
            assert opened, (chat_id, entries)
            assert max(discards) > max(opened), (chat_id, entries)
        for sid in kept:
            status = (await http.get(f"/api/sessions/{sid}", headers=ALICE)).status_code
            assert status == (200 if sid in registered else 404)


def _alice_hash() -> str:
    from gateway.auth import User

    return User("alice").hash


async def test_status_reads_junk_keys_as_nothing(redis_factory) -> None:  # type: ignore[no-untyped-def]
    async with _client(redis_factory) as http:
        sid = (await http.post("/api/sessions", json={}, headers=ALICE)).json()["id"]
        redis, k = redis_factory(), Keys()
        await redis.set(k.inbound(f"web:{sid}"), "junk")  # wrong types where streams belong
        await redis.set(k.out(f"web:{sid}"), "junk")
        status = (await http.get(f"/api/sessions/{sid}", headers=ALICE)).json()
        assert (status["queued"], status["state"], status["last_event_id"]) == (0, "idle", "0-0")


async def test_metrics_count_routes_by_template_for_the_scraper_only(redis_factory) -> None:  # type: ignore[no-untyped-def]
    async with _client(redis_factory) as http:
        sid = (await http.post("/api/sessions", json={}, headers=ALICE)).json()["id"]
        for i in range(2):
            r = await http.post(
                f"/api/sessions/{sid}/messages", json={"content": f"m{i}"}, headers=ALICE
            )
            assert r.status_code == 202
        assert (await http.get("/api/sessions/nope", headers=ALICE)).status_code == 404
        page = await http.get("/metrics")
        assert page.status_code == 200
        body = page.text
        route = "/api/sessions/{session_id}/messages"
        assert f'gateway_requests_total{{method="POST",route="{route}",status="202"}} 2.0' in body
        assert 'route="/api/sessions/{session_id}",status="404"' in body
        assert "gateway_messages_published_total 2.0" in body
        assert sid not in body  # no chat id, user or token anywhere
        assert "alice" not in body
    async with _client(redis_factory, peer="203.0.113.7") as http:  # not the scraper
        assert (await http.get("/metrics")).status_code == 404


async def test_chats_whose_session_the_workers_pruned_leave_the_list(redis_factory) -> None:  # type: ignore[no-untyped-def]
    """A chat created long ago with no stored session left (deleted after its idle time)
    leaves the list and frees its place under the limit; a used one stays."""
    admin = redis_factory()
    async with _client(redis_factory, max_sessions_per_user=2, session_ttl_s=3600) as http:
        a = (await http.post("/api/sessions", json={"title": "a"}, headers=ALICE)).json()["id"]
        b = (await http.post("/api/sessions", json={"title": "b"}, headers=ALICE)).json()["id"]
        assert (await http.post("/api/sessions", json={}, headers=ALICE)).status_code == 409
        (index,) = [k async for k in admin.scan_iter(match="agent:{web}:gw:user:*:sessions")]
        await admin.zadd(index, {a: 1, b: 1})  # both created long ago
        await admin.hset(Keys().session(f"web:{b}"), "count", "2")  # b was used, a pruned
        listed = [c["id"] for c in (await http.get("/api/sessions", headers=ALICE)).json()]
        assert listed == [b]
        assert (await http.post("/api/sessions", json={}, headers=ALICE)).status_code == 201
    # an old chat whose first message is still waiting (no session stored yet) stays:
    # dropping it would leave the session its answer stores to nobody
    async with _client(redis_factory, session_ttl_s=3600) as http:
        c = (await http.post("/api/sessions", json={}, headers=BOB)).json()["id"]
        (index,) = [
            k
            async for k in admin.scan_iter(
                match=f"agent:{{web}}:gw:user:{User('bob').hash}:sessions"
            )
        ]
        await admin.zadd(index, {c: 1})
        sent = await http.post(f"/api/sessions/{c}/messages", json={"content": "q"}, headers=BOB)
        assert sent.status_code == 202
        listed = [x["id"] for x in (await http.get("/api/sessions", headers=BOB)).json()]
        assert listed == [c]
        await admin.delete(Keys().inbound(f"web:{c}"))  # answered: its events remain
        await admin.xadd(Keys().out(f"web:{c}"), {"type": "message"})
        listed = [x["id"] for x in (await http.get("/api/sessions", headers=BOB)).json()]
        assert listed == [c]


async def test_new_conversation_route(redis_factory) -> None:  # type: ignore[no-untyped-def]
    admin = redis_factory()
    async with _client(redis_factory) as http:
        sid = (await http.post("/api/sessions", json={}, headers=ALICE)).json()["id"]
        r = await http.post(f"/api/sessions/{sid}/new", headers=ALICE)
        assert r.json() == {"session_id": sid, "op": "new"}
        (entry,) = await admin.xrange(Keys().inbound(f"web:{sid}"))
        assert entry[1] == {"control": "new"}  # the marker the workers act on
        assert (await http.post(f"/api/sessions/{sid}/new", headers=BOB)).status_code == 404


def test_gateway_command_line_version_and_typos() -> None:
    import subprocess
    import sys

    from gateway.cli import unknown_variables

    version = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert version.stdout.startswith("agent-gateway ")
    env = {"AGENT_GATEWAY_TOKEN": "x", "AGENT_GATEWAY_TOKENS": "t=u", "AGENT_REDIS_URL": "r"}
    assert unknown_variables(env) == ["AGENT_GATEWAY_TOKEN"]


async def test_a_reject_message_to_a_busy_chat_is_409_and_sends_nothing(redis_factory) -> None:  # type: ignore[no-untyped-def]
    """No worker runs: the first message stays queued, so the chat is busy."""
    async with _client(redis_factory) as http:
        chat = (await http.post("/api/sessions", json={}, headers=ALICE)).json()
        path = f"/api/sessions/{chat['id']}/messages"
        first = await http.post(path, json={"content": "one", "followup": "reject"}, headers=ALICE)
        assert first.status_code == 202  # idle: accepted
        busy = await http.post(path, json={"content": "two", "followup": "reject"}, headers=ALICE)
        assert busy.status_code == 409
        assert busy.json()["detail"].startswith("busy")
        queued = await http.post(path, json={"content": "three"}, headers=ALICE)  # default
        assert queued.status_code == 202
        bad = await http.post(path, json={"content": "x", "followup": "later"}, headers=ALICE)
        assert bad.status_code == 422
    async with _client(redis_factory, followup="reject") as http:  # AGENT_GATEWAY_FOLLOWUP
        again = await http.post(path, json={"content": "four"}, headers=ALICE)
        assert again.status_code == 409


def _event(kind: str, text: str, seq: int | None = None) -> OutboundMessage:
    meta = {"seq": seq} if seq is not None else {}
    return OutboundMessage(
        type=kind, channel="web", chat_id="c", session_key="web:c", content=text, metadata=meta
    )  # type: ignore[arg-type]


async def _streamed(events: list[OutboundMessage], monkeypatch: pytest.MonkeyPatch) -> str:
    """What an OpenAI client puts together from the gateway's stream of ``events``."""
    from gateway import openai_compat

    async def replay(*_args: Any) -> AsyncIterator[OutboundMessage]:
        for ev in events:
            yield ev

    monkeypatch.setattr(openai_compat, "_events", replay)
    g = SimpleNamespace(settings=SimpleNamespace(wait_max_s=60))
    text = ""
    async for raw in openai_compat._stream(g, None, None, set(), "0-0", "id", "agent"):  # type: ignore[arg-type]
        line = raw.decode()
        if line.startswith("data: {"):
            for choice in json.loads(line[6:]).get("choices", []):
                text += choice["delta"].get("content") or ""
    return text


async def test_an_openai_stream_goes_on_where_a_lost_worker_stopped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker lost mid-answer: the next attempt's events number from 1 again. The client
    gets each piece of the answer once; an attempt that says something else is not sent
    in pieces after what the client has, its final message comes whole."""
    answer = "re: midway openai answer"
    first = [
        _event("delta", "re: ", 1),
        _event("progress", "working", 2),
        _event("delta", "midw", 3),
    ]
    again = [
        _event("delta", "re: ", 1),
        _event("delta", "midw", 2),
        _event("delta", "ay openai", 3),
    ]
    end = [_event("delta", " answer", 4), _event("message", answer)]
    assert await _streamed([*first, *again, *end], monkeypatch) == answer
    # a duplicated event (seq not higher) is taken as an attempt again: nothing doubled
    once = [_event("delta", "re: ", 1), _event("delta", "re: ", 1), _event("delta", "midway", 2)]
    assert await _streamed([*once, _event("message", "re: midway")], monkeypatch) == "re: midway"
    # workers without sequence numbers: every delta as it comes
    plain = [_event("delta", "a"), _event("delta", "b"), _event("message", "ab")]
    assert await _streamed(plain, monkeypatch) == "ab"
    other = [_event("delta", "re: ", 1), _event("delta", "Hello", 2), _event("delta", "re: ", 1)]
    other += [_event("delta", "Howdy", 2), _event("message", "re: Howdy")]
    assert await _streamed(other, monkeypatch) == "re: Hello" + "re: Howdy"


def test_a_websocket_client_that_stops_reading_is_let_go_by_bytes_too() -> None:
    """Its outbox holds at most ``OUTBOX`` frames and ``OUTBOX_BYTES`` of event text: long
    answers to a client that stopped reading end its socket (it reconnects and resumes)
    before they pile up, however few they are."""
    from gateway.ws import OUTBOX_BYTES, Connection

    conn = Connection(None, None, None)  # type: ignore[arg-type]
    for _ in range(4):
        conn.put({"type": "event"}, OUTBOX_BYTES // 4)
    assert not conn.overflowed
    assert conn.queued_bytes == OUTBOX_BYTES
    conn.put({"type": "event"}, 1)
    assert conn.overflowed
    assert conn.ended.is_set()
    assert conn.outbox.qsize() == 4  # the frame that went past was not queued


async def test_a_redis_that_stops_answering_is_503_after_the_deadline() -> None:
    """A Redis that accepts and never answers (frozen, or busy with a long command): a
    request that does not wait by design is answered 503 at the deadline, not held."""
    async with frozen_gateway() as http:
        for method, path in [("GET", "/api/sessions"), ("POST", "/api/sessions")]:
            # (held for ever without the deadline: a failure here, not a hung suite)
            r = await asyncio.wait_for(http.request(method, path, json={}, headers=ALICE), 10)
            assert r.status_code == 503, (method, path)
            assert "did not answer in time" in r.json()["detail"]
        assert (await asyncio.wait_for(http.get("/readyz"), 10)).status_code == 503


def test_the_routes_that_wait_by_design_have_no_deadline() -> None:
    from gateway.deadline import waits

    def scope(path: str, query: bytes = b"", method: str = "POST") -> dict[str, Any]:
        return {"type": "http", "path": path, "query_string": query, "method": method}

    assert waits(scope("/api/sessions/x/events"))
    assert waits(scope("/v1/chat/completions"))
    assert waits(scope("/api/sessions/x/messages", b"wait=30"))
    assert not waits(scope("/api/sessions/x/messages", b"wait=0"))
    assert not waits(scope("/api/sessions/x/messages", b"wait=soon"))
    assert not waits(scope("/api/sessions"))
    assert not waits(scope("/api/sessions", b"wait=1", "GET"))  # no other route lifts it
    assert not waits(scope("/api/sessions/x/stop", b"wait=1"))


async def test_redis_out_of_memory_is_503_to_retry_and_the_log_holds_no_text(caplog) -> None:  # type: ignore[no-untyped-def]
    """Redis out of memory (or read-only) is Redis' state: 503 with Retry-After, which the
    page retries, not a 500 it does not. A refusal is logged once per kind and period,
    with Redis' words only: redis-py names a failed pipeline's command, arguments (a
    message's text) included, in its error message."""
    import logging

    from redis.exceptions import OutOfMemoryError, ReadOnlyError, ResponseError

    from gateway import errors

    errors._logged.clear()
    oom = await errors.redis_failed(
        None, OutOfMemoryError("command not allowed when used memory > 'maxmemory'.")
    )  # type: ignore[arg-type]
    assert oom.status_code == 503
    assert oom.headers["retry-after"] == "1"
    assert (await errors.redis_failed(None, ReadOnlyError("read only replica"))).status_code == 503  # type: ignore[arg-type]
    piped = ResponseError(
        'Command # 1 (XADD agent:{web}:in:web:x * payload {"content":"SECRET TEXT"}) of '
        "pipeline caused error: WRONGTYPE Operation against a key holding the wrong kind of value"
    )
    with caplog.at_level(logging.WARNING, logger="gateway.app"):
        for _ in range(50):
            assert (await errors.redis_failed(None, piped)).status_code == 500  # type: ignore[arg-type]
    lines = [r.getMessage() for r in caplog.records if r.name == "gateway.app"]
    assert not any("SECRET" in line for line in lines)
    refused = [line for line in lines if "ResponseError" in line]
    assert refused == [  # once for 50 refusals in the period
        "Redis: ResponseError: WRONGTYPE Operation against a key holding the wrong kind of value"
    ]
