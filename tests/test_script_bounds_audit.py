"""A hostile audit of the Lua scripts' bounds (bus_redis/lua/*.lua): what one channel (or
one user, one session) writes must never make a script do work, hold memory or fail in
proportion to it. Each test names what grows, with what, and the bound expected.

Measured on the real server: Redis counts the commands a script runs in ``INFO
commandstats``, and Lua's ``unpack`` refuses more than LUAI_MAXCSTACK (8,000) values, so a
script that unpacks a list a frontend can grow fails past that size (Redis does not roll
back the writes a script made before it failed).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from bus_redis import FrontendClient, InboundMessage, RedisBus
from bus_redis.results import Acquired, CommitSpec, Entry, More

U = "unified:default"  # every durable chat of every channel folds under it (unified mode)


@pytest.fixture
async def bus(real_redis: aioredis.Redis) -> AsyncIterator[RedisBus]:
    b = RedisBus(real_redis, lock_ttl_ms=60_000)
    yield b
    await b.aclose()


@pytest.fixture
async def client(real_redis: aioredis.Redis) -> AsyncIterator[FrontendClient]:
    c = FrontendClient(real_redis)
    yield c
    await c.aclose()


def _msg(channel: str, chat: str, text: str = "hi") -> InboundMessage:
    return InboundMessage(channel=channel, sender_id="u", chat_id=chat, content=text)


async def _calls(redis: aioredis.Redis) -> int:
    """Commands the server has run so far (scripts' inner commands included), INFO's own
    calls left out."""
    stats: dict[str, Any] = await redis.info("commandstats")
    return sum(
        int(v["calls"]) for k, v in stats.items() if k not in ("cmdstat_info", "cmdstat_eval")
    )


async def _unified_flood(
    redis: aioredis.Redis, bus: RedisBus, client: FrontendClient, chats: int
) -> Acquired:
    """A worker holds ``unified:default`` (its turn on ``web:c0`` runs) while the ``web``
    frontend writes one message into each of ``chats`` other chats; every notification
    another worker reads meets the held lease (``acquire.lua`` answers busy and adds the
    chat's stream to the unified key's pending set), as the worker's loop does."""
    await client.send(_msg("web", "c0"))
    held = await bus.acquire(U, "w1", member="web:c0")
    assert isinstance(held, Acquired)
    assert isinstance(held.step, Entry)
    async with redis.pipeline(transaction=False) as pipe:  # a frontend's flood, raw
        for i in range(1, chats + 1):
            pipe.xadd(bus.keys.inbound(f"web:c{i}"), {"payload": "x"})
        await pipe.execute()
    for i in range(1, chats + 1):  # each note read by another worker: busy, pending
        await bus.acquire(U, "w2", member=f"web:c{i}")
    assert await redis.scard(bus.keys.pending(U)) == chats + 1
    return held


async def test_unified_commit_survives_a_flood_of_pending_chats(
    real_redis: aioredis.Redis, bus: RedisBus, client: FrontendClient
) -> None:
    """What grows: the unified key's pending set ``P:{unified}:pending:unified:default``,
    one member per chat a frontend notified while the key was held (``acquire.lua``
    SADDs it before answering busy): a single channel can name any number of chats.
    With it: ``try_release`` (``lua/_common.lua``) reads the whole set (``SMEMBERS``) and
    answers ``{'more', unpack(left)}``: work and a reply in proportion to the set, and
    past Lua's 8,000 values ``unpack`` fails, so every commit, next and acquire of the
    unified key that reaches it raises ``too many results to unpack`` (after the commit's
    writes landed; the lease is left held). Every channel's durable chats fold under
    that one key: one channel's 9,000 chats stop the service for all.
    Expected bound: a step reply (and the set's read) of a fixed size, e.g. ``SRANDMEMBER
    pending N`` / ``SSCAN`` with a COUNT, the holder asking again for the rest."""
    held = await _unified_flood(real_redis, bus, client, 9000)
    entry = held.step
    assert isinstance(entry, Entry)
    spec = CommitSpec(member="web:c0", entry_ids=[entry.entry_id])
    # the holder's commit of its turn selects on (its own stream is now empty)
    _version, _gen, step = await bus.commit(U, held.token, "w1", spec, select=["web:c0"])
    assert isinstance(step, More | Entry)
    if isinstance(step, More):
        assert len(step.members) <= 1000, "a step reply in proportion to the pending set"


async def test_unified_next_call_reads_every_pending_chat(
    real_redis: aioredis.Redis, bus: RedisBus, client: FrontendClient
) -> None:
    """What grows: the streams one ``next.lua`` / ``commit.lua`` call of the unified key
    looks at. The holder passes every member of the ``more`` reply back as a stream to
    select from (``SessionHolder``: ``self.members = set(step.members)``, then
    ``RedisBus.next(key, token, members)``), and ``select_next`` runs ``leave_alone``
    (SISMEMBER, EXISTS, EXISTS) and ``head`` (XRANGE) on each of them to find the oldest
    entry: ~5 commands per chat a frontend notified, on every step of the holder, so
    draining N chats costs O(N^2) and each call blocks Redis for every channel in
    proportion to one channel's flood (2,000 chats: ~10,000 commands in one call).
    Expected bound: a fixed number of streams looked at per call (like HEAD_BATCH for
    markers), whatever the pending set holds."""
    held = await _unified_flood(real_redis, bus, client, 2000)
    entry = held.step
    assert isinstance(entry, Entry)
    spec = CommitSpec(member="web:c0", entry_ids=[entry.entry_id])
    _version, _gen, step = await bus.commit(U, held.token, "w1", spec, select=["web:c0"])
    assert isinstance(step, More)
    members = list(step.members)  # what the holder passes to its next step
    before = await _calls(real_redis)
    nxt = await bus.next(U, held.token, members)
    used = await _calls(real_redis) - before
    assert isinstance(nxt, Entry)
    assert used <= 1000, f"one next() call ran {used} commands for {len(members)} pending chats"


async def test_private_commit_keeps_queued_messages_of_a_wide_entry(
    real_redis: aioredis.Redis, bus: RedisBus, client: FrontendClient
) -> None:
    """What grows: the fields of one inbound entry (a frontend may XADD any number of
    field/value pairs: 5,000 pairs of one-byte values is a 40 KB entry, under every
    payload limit). With it: a private session's commit rewrites the stream's live
    entries (``shed_deleted`` in ``lua/_common.lua``: ``DEL`` then ``XADD key id
    unpack(e[2])`` for each), copying every field of up to 64 entries, with no byte or
    field budget; past 8,000 values ``unpack`` fails after the ``DEL``: the session's
    queued messages are gone, and the answer of the committed turn is never written
    (the script stops before its event). Expected bound: a byte/field budget on what
    ``shed_deleted`` copies (skip the rewrite above it, as it is skipped above 64
    entries), checked before the ``DEL``."""
    s = "web:p"
    await client.send(_msg("web", "p"))
    got = await bus.acquire(s, "w1", member=s, claim_owner=True)
    assert isinstance(got, Acquired)
    assert isinstance(got.step, Entry)
    await real_redis.xadd(bus.keys.inbound(s), {f"f{i}": "v" for i in range(5000)})
    await client.send(_msg("web", "p", "a later message"))
    reply = '{"v":2,"type":"message","channel":"web","chat_id":"p","content":"ok"}'
    spec = CommitSpec(member=s, entry_ids=[got.step.entry_id], reply=reply, transient=True)
    try:
        await bus.commit(s, got.token, "w1", spec, select=[s])
    except Exception as exc:
        failed: Exception | None = exc
    else:
        failed = None
    left = await real_redis.xlen(bus.keys.inbound(s))
    events = await real_redis.xlen(bus.keys.out(s))
    assert (failed, left, events) == (None, 2, 1), (
        f"commit failed with {failed!r}; {left} of 2 queued entries left, {events} answer(s)"
    )
