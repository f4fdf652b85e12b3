"""Replicas of one frontend, under the generated ACLs, with real ``agent-worker run``
processes: each replica receives exactly its own chats' events; a client that reconnects
to another replica resumes a streamed reply by entry id; unified mode folds by the
worker's rule and never drains one stream under two leases."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
import redis.asyncio as aioredis

from bus_redis import FrontendClient, InboundMessage, OutboundMessage
from bus_redis.acl import frontend_acl, worker_acl

pytestmark = [pytest.mark.real_redis, pytest.mark.slow]
PW = "replica-pw-1"


async def _acl_urls(admin: aioredis.Redis, url: str) -> tuple[str, str]:
    for line in [*frontend_acl("web", PW), *worker_acl(PW)]:
        await admin.execute_command(*line.split())
    return (
        url.replace("redis://", f"redis://frontend-web:{PW}@"),
        url.replace("redis://", f"redis://agent-worker:{PW}@"),
    )


async def _kept(client: FrontendClient, session_key: str):  # type: ignore[no-untyped-def]
    """Every event kept for a session, then stop (XRANGE: no waiting)."""
    for eid, fields in await client.redis.xrange(client.keys.out(session_key)):
        ev = OutboundMessage.model_validate_json(fields["payload"])
        ev.entry_id = eid
        yield ev


async def _until_terminal(
    client: FrontendClient, chats: list[str], want: int
) -> list[OutboundMessage]:
    events: list[OutboundMessage] = []
    async for ev in client.events(chats, after="0"):
        events.append(ev)
        if sum(e.is_terminal for e in events) >= want:
            return events
    raise AssertionError("unreachable")


async def test_three_replicas_each_get_exactly_their_own_chats(
    real_redis: aioredis.Redis, redis_server, spawn_workers
) -> None:  # type: ignore[no-untyped-def]
    frontend_url, worker_url = await _acl_urls(real_redis, redis_server.url)
    spawn_workers(2, url=worker_url)
    replicas = [
        FrontendClient(aioredis.from_url(frontend_url, decode_responses=True)) for _ in range(3)
    ]

    async def serve(n: int, client: FrontendClient) -> tuple[set[str], list[OutboundMessage]]:
        chats = [f"r{n}-{i}" for i in range(30)]
        ids = {
            await client.send(InboundMessage(id=f"{n}-{c}", channel="web", sender_id=c, chat_id=c, content=f"hi {c}"))
            for c in chats
        }  # fmt: skip
        events = await _until_terminal(client, [f"web:{c}" for c in chats], 30)
        return ids, events

    try:
        results = await asyncio.wait_for(
            asyncio.gather(*(serve(n, c) for n, c in enumerate(replicas))), 60
        )
    finally:
        for c in replicas:
            await c.redis.aclose()
    for n, (ids, events) in enumerate(results):
        assert {e.reply_to for e in events if e.is_terminal} == ids
        assert all(e.session_key.startswith(f"web:r{n}-") for e in events)


async def test_a_reconnect_to_another_replica_resumes_a_streamed_reply(
    real_redis: aioredis.Redis, redis_server, spawn_workers, fake_llm
) -> None:  # type: ignore[no-untyped-def]
    frontend_url, worker_url = await _acl_urls(real_redis, redis_server.url)
    spawn_workers(1, url=worker_url, env={"AGENT_STREAM_DELTAS": "1"})
    a = FrontendClient(aioredis.from_url(frontend_url, decode_responses=True))
    b = FrontendClient(aioredis.from_url(frontend_url, decode_responses=True))
    key = "web:stream"
    try:
        await a.send(
            InboundMessage(
                id="s1",
                channel="web",
                sender_id="u",
                chat_id="stream",
                content="reply midway please",
            )
        )
        seen_by_a: list[OutboundMessage] = []
        events = a.events([key], after="0")
        async for ev in events:  # the first half of the reply reaches replica A ...
            seen_by_a.append(ev)
            if len(seen_by_a) == 2:
                break
        await events.aclose()  # ... then the client's connection drops
        assert [e.type for e in seen_by_a] == ["delta", "delta"]
        fake_llm.release()
        seen_by_b: list[OutboundMessage] = []
        async for ev in b.events([key], after=seen_by_a[-1].entry_id or "0"):  # replica B
            seen_by_b.append(ev)
            if ev.is_terminal:
                break
    finally:
        await a.redis.aclose()
        await b.redis.aclose()
    deltas = [e.content for e in [*seen_by_a, *seen_by_b] if e.type == "delta"]
    final = seen_by_b[-1]
    assert final.type == "message"
    assert "".join(deltas) == final.content == "re: reply midway please"
    ids = [e.entry_id for e in [*seen_by_a, *seen_by_b]]
    assert len(ids) == len(set(ids))  # nothing doubled


async def test_unified_mode_drains_each_stream_under_one_lease(
    real_redis: aioredis.Redis, spawn_workers, fake_llm
) -> None:  # type: ignore[no-untyped-def]
    """The same chat published without an override and with an override equal to
    channel:chat_id is one session key, one stream, one lease: every message reaches the
    model exactly once and no two turns of the unified session overlap."""
    spawn_workers(2, env={"AGENT_UNIFIED_SESSION": "1", "AGENT_FOLLOWUP_MODE": "queue"})
    client = FrontendClient(real_redis)
    sent: list[str] = []
    ids: dict[str, set[str]] = {"42": set(), "43": set()}
    for i in range(6):
        for chat, override in (("42", None), ("42", "web:42"), ("43", None)):
            text = f"[u] {chat}-{'o' if override else 'd'}{i}"
            msg = InboundMessage(channel="web", sender_id="u", chat_id=chat, content=text,
                                 session_key_override=override)  # fmt: skip
            sent.append(text)
            ids[chat].add(await client.send(msg))
    # a canary after everything: once it is answered, every earlier turn has committed
    canary = await client.ask(InboundMessage(channel="web", sender_id="u", chat_id="43", content="[u] canary"), timeout_s=60)  # fmt: skip
    assert canary.type == "message"
    for chat in ("42", "43"):
        kept = [e async for e in _kept(client, f"web:{chat}")]
        terminal = [e for e in kept if e.is_terminal and e.reply_to != canary.reply_to]
        assert sorted(e.reply_to or "" for e in terminal) == sorted(ids[chat])  # once each
        assert all(e.type == "message" for e in terminal), terminal
    last_user = Counter(
        next(m["content"] for m in reversed(r["messages"]) if m["role"] == "user")
        for r in fake_llm.requests
    )
    assert {t: last_user[t] for t in sent} == dict.fromkeys(sent, 1)
    assert fake_llm.overlaps == 0
