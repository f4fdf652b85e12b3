"""The gateway end to end: two ``agent-gateway`` replicas and two ``agent-worker run``
processes on a real redis-server, each under its generated ACL user (``acl gateway`` /
``acl worker``), a local OpenAI-compatible fake LLM behind the workers.

Covered: send, stream, ``?wait=``, stop, a temporary chat and its discard, resume on the
other replica with nothing lost or doubled, a duplicate client id, delete, one user never
seeing another's chats or events, forged scope / override / metadata ignored, the
WebSocket carrying several chats, and the OpenAI-compatible endpoint driven by ``openai``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from sse import sse
from stacks import ALICE, BOB, Stack, running_stack

from bus_redis.keys import Keys

pytestmark = [pytest.mark.real_redis, pytest.mark.slow, pytest.mark.frontend]


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with running_stack(gateways=2, workers=2) as st:
        yield st


async def _chat(http: httpx.AsyncClient, base: str, *, temporary: bool = False) -> str:
    r = await http.post(f"{base}/api/sessions", json={"temporary": temporary}, headers=ALICE)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


async def _send(
    http: httpx.AsyncClient,
    base: str,
    sid: str,
    body: dict[str, Any],
    *,
    wait: float = 20,
    headers: dict[str, str] = ALICE,
) -> dict[str, Any]:
    r = await http.post(
        f"{base}/api/sessions/{sid}/messages?wait={wait}", json=body, headers=headers
    )
    assert r.status_code in (200, 202), r.text
    return dict(r.json())


async def test_send_wait_stream_and_history_across_replicas(stack: Stack) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        sid = await _chat(http, stack.a)
        got = await _send(http, stack.b, sid, {"content": "hello", "client_id": "m1"})
        assert got["event"]["type"] == "message"
        assert got["event"]["content"] == "re: hello"
        assert got["event"]["reply_to"] == "m1"
        assert got["cursor"] == "0-0"
        # the stream on replica A replays from the cursor what replica B's send produced
        replayed = []
        async for ev in sse(http, f"{stack.a}/api/sessions/{sid}/events?after=0", headers=ALICE):
            replayed.append(ev)
            if ev["event"] == "message":
                break
        final = replayed[-1]
        assert final["id"] == got["event"]["id"]
        assert final["data"]["session_id"] == sid
        assert "".join(e["data"]["content"] for e in replayed[:-1]) == "re: hello"
        history = (await http.get(f"{stack.a}/api/sessions/{sid}/messages", headers=ALICE)).json()
        assert [(h["role"], h["content"]) for h in history] == [
            ("user", "hello"),
            ("assistant", "re: hello"),
        ]
        status = (await http.get(f"{stack.b}/api/sessions/{sid}", headers=ALICE)).json()
        assert status["state"] == "idle"
        assert status["queued"] == 0
        assert status["messages"] == 2
        assert status["title"] == "hello"
        assert status["last_event_id"] == got["event"]["id"]
        listed = (await http.get(f"{stack.b}/api/sessions", headers=ALICE)).json()
        assert sid in [c["id"] for c in listed]


async def test_a_reposted_client_id_never_runs_a_second_turn(stack: Stack) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        sid = await _chat(http, stack.a)
        body = {"content": "count me once", "client_id": "dup-1"}
        first = await _send(http, stack.a, sid, body)
        again = await _send(http, stack.b, sid, body)
        assert again["event"]["content"] == first["event"]["content"] == "re: count me once"
        assert again["event"]["metadata"].get("duplicate") is True
        calls = [r for r in stack.llm.requests if "count me once" in json.dumps(r)]
        assert len(calls) == 1
        history = (await http.get(f"{stack.a}/api/sessions/{sid}/messages", headers=ALICE)).json()
        assert [h["content"] for h in history].count("count me once") == 1


async def test_stop_cancels_the_running_turn(stack: Stack) -> None:
    stack.llm.rearm()
    async with httpx.AsyncClient(timeout=30) as http:
        sid = await _chat(http, stack.a)
        accepted = await _send(http, stack.a, sid, {"content": "block please"}, wait=0)
        assert await asyncio.to_thread(stack.llm.started.wait, 20)
        running = (await http.get(f"{stack.b}/api/sessions/{sid}", headers=ALICE)).json()
        assert running["state"] == "running"
        r = await http.post(f"{stack.b}/api/sessions/{sid}/stop", headers=ALICE)
        assert r.status_code == 202
        url = f"{stack.a}/api/sessions/{sid}/events?after={accepted['cursor']}"
        async for ev in sse(http, url, headers=ALICE):
            if ev["data"]["reply_to"] == accepted["message_id"] and ev["event"] == "error":
                assert ev["data"]["code"] == "cancelled"
                break
    stack.llm.release()


async def test_resume_on_the_other_replica_loses_and_doubles_nothing(stack: Stack) -> None:
    stack.llm.rearm()
    async with httpx.AsyncClient(timeout=30) as http:
        sid = await _chat(http, stack.a)
        accepted = await _send(http, stack.a, sid, {"content": "midway story"}, wait=0)
        seen: list[dict[str, Any]] = []
        url = f"{stack.a}/api/sessions/{sid}/events?after={accepted['cursor']}"
        async for ev in sse(http, url, headers=ALICE):  # two deltas, then the reply is held
            seen.append(ev)
            if len(seen) == 2:
                break
        stack.llm.release()
        resume = {**ALICE, "Last-Event-ID": seen[-1]["id"]}
        async for ev in sse(http, f"{stack.b}/api/sessions/{sid}/events", headers=resume):
            seen.append(ev)
            if ev["event"] == "message":
                break
    ids = [e["id"] for e in seen]
    assert len(ids) == len(set(ids))
    assert ids == sorted(ids, key=lambda i: tuple(map(int, i.split("-"))))
    deltas = "".join(e["data"]["content"] for e in seen if e["event"] == "delta")
    assert seen[0]["event"] == "delta"
    assert deltas == seen[-1]["data"]["content"] == "re: midway story"


async def test_a_temporary_chat_is_private_and_ends_when_discarded(stack: Stack) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        sid = await _chat(http, stack.a, temporary=True)
        got = await _send(http, stack.b, sid, {"content": "my secret is PIN-4711-XQZ"})
        assert got["event"]["content"] == "re: my secret is PIN-4711-XQZ"
        listed = (await http.get(f"{stack.a}/api/sessions", headers=ALICE)).json()
        assert sid not in [c["id"] for c in listed]
        assert (await http.get(f"{stack.a}/api/sessions/{sid}", headers=BOB)).status_code == 404
        assert (
            await http.post(f"{stack.a}/api/sessions/{sid}/discard", headers=BOB)
        ).status_code == 404
        assert (
            await http.get(f"{stack.a}/api/sessions/{sid}/messages", headers=ALICE)
        ).json() == []
        tools = json.dumps(stack.llm.requests[-1].get("tools", []))
        assert "create_goal" not in tools
        assert "spawn" not in tools
        r = await http.post(f"{stack.b}/api/sessions/{sid}/discard", headers=ALICE)
        assert r.status_code == 202
        r = await http.post(
            f"{stack.a}/api/sessions/{sid}/messages",
            json={"content": "still there?"},
            headers=ALICE,
        )
        assert r.status_code == 404  # gone for its owner too
        made_up = sid[:-4] + "abcd"  # a temporary id the gateway never opened
        assert (
            await http.get(f"{stack.a}/api/sessions/{made_up}/events", headers=ALICE)
        ).status_code == 404
    for key in stack.admin.scan_iter(count=1000):
        if stack.admin.type(key) in ("hash", "string", "zset"):
            assert "PIN-4711-XQZ" not in str(stack.admin.dump(key)), key


async def test_delete_removes_the_chat_its_history_and_events(stack: Stack) -> None:
    keys = Keys()
    async with httpx.AsyncClient(timeout=30) as http:
        sid = await _chat(http, stack.a)
        await _send(http, stack.a, sid, {"content": "to be deleted"})
        assert stack.admin.exists(keys.session(f"web:{sid}"))
        assert (await http.delete(f"{stack.b}/api/sessions/{sid}", headers=BOB)).status_code == 404
        assert (
            await http.delete(f"{stack.b}/api/sessions/{sid}", headers=ALICE)
        ).status_code == 204
        assert (await http.get(f"{stack.a}/api/sessions/{sid}", headers=ALICE)).status_code == 404
        for _ in range(200):  # the worker applies the marker under the session's lease
            if not stack.admin.exists(keys.session(f"web:{sid}"), keys.out(f"web:{sid}")):
                break
            await asyncio.sleep(0.05)
        assert not stack.admin.exists(keys.session(f"web:{sid}"), keys.out(f"web:{sid}"))


async def test_one_user_never_sees_another_users_chats(stack: Stack) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        sid = await _chat(http, stack.a)
        await _send(http, stack.a, sid, {"content": "alice only"})
        assert sid not in [
            c["id"] for c in (await http.get(f"{stack.b}/api/sessions", headers=BOB)).json()
        ]
        for method, path in [
            ("GET", ""),
            ("GET", "/messages"),
            ("POST", "/stop"),
            ("POST", "/discard"),
            ("DELETE", ""),
            ("GET", "/events?after=0"),
        ]:
            r = await http.request(method, f"{stack.b}/api/sessions/{sid}{path}", headers=BOB)
            assert r.status_code == 404, (method, path, r.status_code)
        r = await http.post(
            f"{stack.b}/api/sessions/{sid}/messages", json={"content": "x"}, headers=BOB
        )
        assert r.status_code == 404
        assert (await http.get(f"{stack.a}/api/sessions")).status_code == 401
        bad = {"Authorization": "Bearer tok-alice-01234567"}  # a prefix of alice's token
        assert (await http.get(f"{stack.a}/api/sessions", headers=bad)).status_code == 401
        bob_ticket = (await http.post(f"{stack.a}/api/tickets", headers=BOB)).json()["ticket"]
        r = await http.get(f"{stack.b}/api/sessions/{sid}/events?ticket={bob_ticket}&after=0")
        assert r.status_code == 404
        assert (
            await http.get(
                f"{stack.b}/api/sessions/{sid}/events?ticket=forged-ticket-0000000000&after=0"
            )
        ).status_code == 401


async def test_forged_scope_override_and_metadata_from_the_client_are_ignored(stack: Stack) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        sid = await _chat(http, stack.a)
        forged = {
            "content": "forgery",
            "scope": "bob",
            "session_key_override": "web:bob-chat",
            "require_existing_session": True,
            "channel": "telegram",
            "sender_id": "bob",
            "metadata": {"_runtime_control": "session_discard", "lang": "en"},
        }
        got = await _send(http, stack.a, sid, forged)
        assert got["event"]["content"] == "re: forgery"  # ran as a normal durable turn
        assert got["event"]["metadata"]["lang"] == "en"
        assert "_runtime_control" not in got["event"]["metadata"]
    meta = json.loads(stack.admin.hget(Keys().session(f"web:{sid}"), "meta") or "{}")
    assert meta["scope"].startswith("web/scope:user-")
    assert "bob" not in meta["scope"]
    assert not stack.admin.exists(Keys().session("web:bob-chat"))


async def test_one_websocket_carries_several_chats(stack: Stack) -> None:
    from websockets.asyncio.client import connect

    async with httpx.AsyncClient(timeout=30) as http:
        one, two = await _chat(http, stack.a), await _chat(http, stack.a)
        ticket = (await http.post(f"{stack.b}/api/tickets", headers=ALICE)).json()["ticket"]
        ws_url = stack.b.replace("http://", "ws://") + f"/api/ws?ticket={ticket}"
        async with connect(ws_url) as ws:
            for sid in (one, two):
                await ws.send(json.dumps({"op": "subscribe", "session_id": sid, "after": "0"}))
            await _send(http, stack.a, one, {"content": "first chat"}, wait=0)
            await _send(http, stack.a, two, {"content": "second chat"}, wait=0)
            finals: dict[str, str] = {}
            while len(finals) < 2:
                frame = json.loads(await asyncio.wait_for(ws.recv(), 20))
                if frame["type"] == "event" and frame["event"]["type"] == "message":
                    finals[frame["session_id"]] = frame["event"]["content"]
            assert finals == {one: "re: first chat", two: "re: second chat"}
            await ws.send(json.dumps({"op": "subscribe", "session_id": "not-mine"}))
            frame = json.loads(await asyncio.wait_for(ws.recv(), 20))
            assert frame["type"] == "error"


async def test_the_openai_compatible_endpoint(stack: Stack) -> None:
    from openai import AsyncOpenAI, NotFoundError

    alice = AsyncOpenAI(base_url=f"{stack.a}/v1", api_key="tok-alice-0123456789")
    out = await alice.chat.completions.create(
        model="agent", messages=[{"role": "user", "content": "my name is Ann"}], user="ann"
    )
    assert out.choices[0].message.content == "re: my name is Ann"
    chunks = await alice.chat.completions.create(
        model="agent",
        messages=[{"role": "user", "content": "streamed please"}],
        user="ann",
        stream=True,
    )
    text = "".join([c.choices[0].delta.content or "" async for c in chunks])
    assert text == "re: streamed please"
    # one conversation per (caller, user): ann's two turns share a history, zed's does not
    ann = [r for r in stack.llm.requests if "streamed please" in json.dumps(r)][-1]
    assert "my name is Ann" in json.dumps(ann["messages"])
    await alice.chat.completions.create(
        model="agent", messages=[{"role": "user", "content": "who am i"}], user="zed"
    )
    zed = [r for r in stack.llm.requests if "who am i" in json.dumps(r)][-1]
    assert "my name is Ann" not in json.dumps(zed["messages"])
    bob = AsyncOpenAI(base_url=f"{stack.b}/v1", api_key="tok-bob-0123456789")
    async with httpx.AsyncClient(timeout=30) as http:
        alice_chats = (await http.get(f"{stack.a}/api/sessions", headers=ALICE)).json()
    with pytest.raises(NotFoundError):
        await bob.chat.completions.create(
            model="agent",
            messages=[{"role": "user", "content": "hi"}],
            extra_headers={"X-Session-Id": alice_chats[0]["id"]},
        )
    await alice.close()
    await bob.close()


async def test_redis_connections_stay_bounded_however_many_streams_are_open(stack: Stack) -> None:
    """80 open SSE streams on one replica: the gateways' Redis connections stay within
    their pools (16 pooled + 8 readers each), not one per stream."""
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=200)) as http:
        chats = [await _chat(http, stack.a) for _ in range(80)]
        async with contextlib.AsyncExitStack() as streams:
            for sid in chats:
                r = await streams.enter_async_context(
                    http.stream("GET", f"{stack.a}/api/sessions/{sid}/events", headers=ALICE)
                )
                lines = r.aiter_lines()
                assert (await anext(lines)).startswith(":")  # the stream is open
            clients = [c for c in stack.admin.client_list() if c.get("user") == "gateway-web"]
            assert len(clients) <= 2 * (16 + 8), len(clients)
            # and a chat still gets its reply while they are open
            got = await _send(http, stack.b, chats[-1], {"content": "still served"})
            assert got["event"]["content"] == "re: still served"


async def test_a_forwarded_for_header_does_not_make_a_trusted_proxy(stack: Stack) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        spoof = {"X-Forwarded-User": "alice", "X-Forwarded-For": "10.9.9.9"}
        assert (await http.get(f"{stack.a}/api/sessions", headers=spoof)).status_code == 401


async def test_hostile_websocket_frames_get_errors_and_a_slow_reader_is_let_go(
    stack: Stack,
) -> None:
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    async with httpx.AsyncClient(timeout=30) as http:
        ticket = (await http.post(f"{stack.a}/api/tickets", headers=ALICE)).json()["ticket"]
        url = stack.a.replace("http://", "ws://") + f"/api/ws?ticket={ticket}"
        async with connect(url) as ws:
            await ws.send(b"\x00binary")
            assert json.loads(await ws.recv())["message"] == "text frames only"
            await ws.send("not json")
            assert json.loads(await ws.recv())["type"] == "error"
            await ws.send(
                json.dumps(
                    {"op": "subscribe", "session_id": "x", "after": "99999999999999999999999-0"}
                )
            )
            assert json.loads(await ws.recv())["type"] == "error"
        async with connect(url, max_size=None) as ws:  # a frame over 64 KiB: refused
            await ws.send("x" * 70_000)
            with pytest.raises(ConnectionClosed):
                await asyncio.wait_for(ws.recv(), 10)
