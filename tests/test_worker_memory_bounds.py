"""Bounded memory and work inside a worker process: every in-process table holds a bound
that one channel cannot grow, and one channel must not be able to push another channel's
entries out of a shared table so that the other channel's turns cost more (a reload of
its session or its memory every turn). Each test states the bound it checks."""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from helpers import answering
from hypothesis import given
from hypothesis import strategies as st
from replies import open_private

from bus_redis import FrontendClient, InboundMessage, Keys
from session_store.manager import SessionManager
from session_store.memory import MemoryStore
from session_store.models import Session
from session_store.shares import Shares

K = Keys()


class _CountingStore:
    """A SessionStore whose loads are counted: each stored session has ``rows`` rows at
    version 1 of generation ``g``."""

    def __init__(self, rows: int = 4) -> None:
        self.rows = rows
        self.loads: list[str] = []

    def _session(self, key: str) -> Session:
        s = Session(key=key, scope=key.replace(":", "/sender:", 1))
        s.messages = [
            {"role": "user" if i % 2 == 0 else "assistant", "content": f"{key} {i}"}
            for i in range(self.rows)
        ]
        s.mark_persisted(1, "g")
        return s

    async def load_recent(self, key: str) -> Session:
        self.loads.append(key)
        return self._session(key)

    async def load(self, key: str) -> Session:
        self.loads.append(key)
        return self._session(key)

    async def load_since(self, cached: Session, ahead: Any) -> bool:
        return False

    def cached(self, session: Session) -> Any:
        return None


async def test_one_channels_new_sessions_do_not_push_another_channels_session_out() -> None:
    """The session cache (``SessionManager``: ``AGENT_SESSION_CACHE_SESSIONS`` sessions,
    ``AGENT_SESSION_CACHE_ROWS`` rows) is one LRU for every channel. A frontend that
    writes to as many new chats as the cache holds (16,384 by default: one message each)
    evicts every other channel's sessions, so each of their turns reloads its session
    from Redis (``load_recent``: the unconsolidated rows and the newest 512), for as long
    as the flood goes on. Private sessions have a share per channel ("a channel cannot
    take another channel's share", docs/SECURITY.md); the durable cache must too: a
    channel holding one cached session keeps it while another channel churns the rest.
    (A cache of 64 sessions here stands for the default's 16,384.)"""
    store = _CountingStore()
    manager = SessionManager(store, cache_size=64, cache_rows=100_000)  # type: ignore[arg-type]
    await manager.load_for_turn("web:alice", 1, "g")
    assert store.loads == ["web:alice"]
    for i in range(64):  # another channel's flood: one new chat each
        await manager.load_for_turn(f"bot:chat-{i}", 1, "g")
    store.loads.clear()
    await manager.load_for_turn("web:alice", 1, "g")  # alice's next turn
    assert store.loads == [], "the other channel's flood evicted web:alice: it was reloaded"


async def test_one_channels_long_sessions_do_not_push_another_channels_session_out() -> None:
    """The same cache's row bound (250,000 by default, "~150 MB"): one channel's few long
    sessions (their unconsolidated rows are all loaded) take every row of it and evict
    every other channel's sessions. Here a cache of 1,000 rows: the other channel's two
    sessions of 600 rows evict web:alice's 4 rows."""
    store = _CountingStore()
    manager = SessionManager(store, cache_size=64, cache_rows=1_000)  # type: ignore[arg-type]
    await manager.load_for_turn("web:alice", 1, "g")
    store.rows = 600
    for i in range(2):
        await manager.load_for_turn(f"bot:long-{i}", 1, "g")
    store.rows = 4
    store.loads.clear()
    await manager.load_for_turn("web:alice", 1, "g")
    assert store.loads == [], "the other channel's long sessions evicted web:alice"


async def test_one_channels_users_do_not_empty_another_channels_memory_cache(
    redis: aioredis.Redis,
) -> None:
    """``MemoryStore`` keeps each scope's long-term memory text by version, so a turn
    whose lease script read an unchanged version makes no round trip for it. The cache
    is one table for every channel, emptied whole once it holds 1,024 scopes: a channel
    with 1,025 users talking (each its own scope, ``<channel>/sender:<id>``) empties it
    again and again, and every other channel's turn reads its memory from Redis each time
    (the text, however long the memory grew). Another channel's cached scope must stay.

    Shown without counting calls: after the flood, web's memory is changed in Redis
    *without* a new version (which no writer does); a cached copy answers the old text,
    a reload the new one."""
    memory = MemoryStore(redis, K)
    version = await memory.write_memory("alice likes tea", "web/sender:alice")
    assert await memory.read_cached(version, "web/sender:alice") == "alice likes tea"
    for i in range(1_025):  # another channel's users, one turn each
        await memory.read_cached(1, f"bot/sender:user-{i}")
    await redis.hset(K.memory("web/sender:alice"), "content", "reloaded")
    got = await memory.read_cached(version, "web/sender:alice")
    assert got == "alice likes tea", "another channel's users emptied web's memory cache"


PRIVATE_ROWS = 10  # AGENT_PRIVATE_HISTORY_ROWS' least value
PRIVATE_BYTES = 1 << 20  # a budget a private history could be held to (none exists)


def _held_bytes(session: Session) -> int:
    return sum(len(str(row.get("content") or "")) for row in session.messages)


async def test_a_private_history_is_bounded_in_bytes_not_only_in_rows(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """A private session lives only in its worker's memory (Redis keeps none of its rows:
    its inbound entries go once answered). Its bound is in rows only: the newest
    ``AGENT_PRIVATE_HISTORY_ROWS`` (400), for ``AGENT_MAX_PRIVATE_SESSIONS`` (1,000)
    sessions per channel (docs/SECURITY.md: "Memory it can make workers hold is
    bounded"). A row is as long as a payload (``AGENT_MAX_PAYLOAD_BYTES``, 256 KiB), so
    one channel may make one worker hold 1,000 x 400 x 256 KiB = 100 GiB, in proportion
    to what it wrote, with nothing in Redis to show for it (the durable cache sizes its
    250,000 rows at "~600 B each"). Ten messages of 240 KB (ten rows, five of them
    theirs) make one private session hold 1.2 MB; a history over a byte budget (1 MiB
    here) must lose its oldest rows as one over its row bound does."""
    loop = make_loop(answering("ok"), private_history_rows=PRIVATE_ROWS)
    client = FrontendClient(redis)
    key = await open_private(client, "big")
    chat = key.split(":", 1)[1]
    for i in range(PRIVATE_ROWS):
        msg = InboundMessage(
            channel="web", sender_id="u", chat_id=chat, content=f"{i}" + "x" * 240_000,
            id=f"m{i}", session_key_override=key, require_existing_session=True,
        )  # fmt: skip
        reply = await client.ask(msg, timeout_s=10)
        assert reply.code is None, reply
    session = loop.sessions.get_cached(key)
    assert session is not None
    assert loop.sessions.is_transient(key)
    assert len(session.messages) <= PRIVATE_ROWS  # the row bound holds
    held = _held_bytes(session)
    assert held <= PRIVATE_BYTES, f"one private session holds {held} bytes of {PRIVATE_ROWS} rows"


@given(
    st.lists(
        st.tuples(st.sampled_from("abc"), st.integers(0, 9), st.integers(0, 50), st.booleans()),
        max_size=60,
    )
)
def test_shares_evict_from_the_channel_holding_most_and_keep_their_sums(ops: list) -> None:  # type: ignore[type-arg]
    """``Shares`` (the caches' fair eviction): whatever the puts and drops, the totals are
    the sums of the entries' weights, and a victim is the least recently used entry of
    the channel holding the most of the weight, never the entry kept."""
    shares, model = Shares(2), {}  # model: key -> (channel, weights, last use)
    for step, (channel, n, rows, drop) in enumerate(ops):
        key = f"{channel}:{n}"
        if drop:
            shares.drop(key)
            model.pop(key, None)
        else:
            if key in model and model[key][0] != channel:
                continue
            shares.put(channel, key, (1, rows))
            model[key] = (channel, (1, rows), step)
        for w in range(2):
            assert shares.totals[w] == sum(v[1][w] for v in model.values())
        keep = key
        victim = shares.victim(1, keep)
        others = {k: v for k, v in model.items() if k != keep}
        if not others:
            assert victim is None
            continue
        assert victim is not None
        assert victim != keep
        sums: dict[str, int] = {}
        for c, weights, _ in model.values():
            sums[c] = sums.get(c, 0) + weights[1]
        best = max(sums[v[0]] for v in others.values())
        assert sums[model[victim][0]] == best
        mine = [k for k, v in others.items() if v[0] == model[victim][0]]
        assert victim == min(mine, key=lambda k: model[k][2])
