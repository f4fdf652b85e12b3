"""RedisSessionStore and SessionManager on fakeredis and a real redis-server."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from bus_redis import FrontendClient, InboundMessage, Keys
from bus_redis.mux import Multiplexed
from bus_redis.results import Acquired, Ahead, Entry, Released
from bus_redis.streams import RedisBus
from session_store import RedisSessionStore, Session, SessionManager
from session_store.redis_store import ROWS_AHEAD


def _store(redis: aioredis.Redis) -> RedisSessionStore:
    return RedisSessionStore(redis, Keys())


async def test_save_load_read_roundtrip(redis: aioredis.Redis) -> None:
    store = _store(redis)
    session = Session(key="web:a", metadata={"title": "hello"})
    session.add_message("user", "hi", message_id="m1")
    session.add_message("assistant", "hey")
    await store.save(session)

    loaded = await store.load("web:a")
    assert loaded is not None
    assert [m["content"] for m in loaded.messages] == ["hi", "hey"]
    assert loaded.metadata == {"title": "hello"}
    assert loaded.version == session.version >= 1
    assert loaded.has_seen("m1")
    payload = await store.read("web:a")
    assert payload is not None
    assert set(payload) == {"key", "created_at", "updated_at", "metadata", "scope", "messages"}
    assert await store.read("web:missing") is None
    assert await store.load("web:missing") is None


async def test_update_metadata_is_a_merge_that_leaves_history_alone(redis: aioredis.Redis) -> None:
    store = _store(redis)
    session = Session(key="web:m", metadata={"a": 1})
    session.add_message("user", "keep me")
    await store.save(session)
    before = await redis.hgetall(Keys().session("web:m"))

    assert await store.update_metadata("web:m", {"b": 2})
    after = await redis.hgetall(Keys().session("web:m"))
    meta = await store.read_metadata("web:m")

    assert meta is not None
    assert meta["metadata"] == {"a": 1, "b": 2}
    assert after["m:0"] == before["m:0"]
    assert int(after["version"]) == int(before["version"]) + 1
    assert not await store.update_metadata("web:none", {"x": 1})


async def test_list_and_delete(redis: aioredis.Redis) -> None:
    manager = SessionManager(_store(redis))
    for key in ("web:1", "web:2"):
        s = await manager.get_or_create(key)
        s.add_message("user", key)
        await manager.save(s)
    listed = [info["key"] for info in await manager.list_sessions()]
    assert sorted(listed) == ["web:1", "web:2"]

    assert await manager.delete_session("web:1")
    assert manager.get_cached("web:1") is None
    assert [info["key"] for info in await manager.list_sessions()] == ["web:2"]
    assert not await manager.delete_session("web:1")


async def test_cache_is_used_only_at_the_current_version(redis: aioredis.Redis) -> None:
    store = _store(redis)
    manager = SessionManager(store)
    s = await manager.get_or_create("web:v")
    s.add_message("user", "one")
    await manager.save(s)
    assert await manager.load_for_turn("web:v", s.version, s.generation) is s  # no reload

    other = await store.load("web:v")  # another worker writes a newer version
    assert other is not None
    other.add_message("user", "two")
    await store.save(other)

    fresh = await manager.load_for_turn("web:v", other.version, other.generation)
    assert fresh is not s
    assert [m["content"] for m in fresh.messages] == ["one", "two"]


async def test_a_deleted_and_recreated_session_never_validates_a_stale_copy(
    redis: aioredis.Redis,
) -> None:
    """Versions restart when a hash is re-created; its generation does not repeat."""
    store = _store(redis)
    manager = SessionManager(store)
    stale = await manager.get_or_create("web:d")
    stale.add_message("user", "deleted secret")
    await manager.save(stale)
    assert await store.delete("web:d")  # another process deletes it (under the lease)

    again = Session(key="web:d")
    again.add_message("user", "new")
    await store.save(again)  # re-created: version 1 again
    assert again.version == stale.version == 1
    assert again.generation != stale.generation

    loaded = await manager.load_for_turn("web:d", again.version, again.generation)
    assert [m["content"] for m in loaded.messages] == ["new"]


async def test_delete_waits_for_the_lease_holder(redis: aioredis.Redis) -> None:
    store = _store(redis)
    session = Session(key="web:busy")
    session.add_message("user", "x")
    await store.save(session)
    await redis.set(store.keys.lease("web:busy"), "n|worker", px=60_000)
    with pytest.raises(TimeoutError, match="stayed busy"):
        await store.delete("web:busy", timeout_s=0.2)
    assert await store.load("web:busy") is not None  # untouched while the turn holds it
    await redis.delete(store.keys.lease("web:busy"))
    assert await store.delete("web:busy")
    assert await store.load("web:busy") is None
    assert not await redis.exists(store.keys.lease("web:busy"))


async def test_transient_sessions_are_pinned_and_never_saved(redis: aioredis.Redis) -> None:
    manager = SessionManager(_store(redis), cache_size=2)
    private = manager.get_or_create_transient("web:p", disabled_tools={"spawn"})
    private.add_message("user", "secret")
    await manager.save(private)
    for i in range(5):  # durable traffic evicts durable entries, never the transient one
        await manager.get_or_create(f"web:d{i}")

    assert manager.get_cached("web:p") is private
    assert manager.get_cached("web:d0") is None  # durable entries were evicted ...
    assert manager.get_cached("web:d4") is not None  # ... oldest first
    assert private.policy.disabled_tools == {"spawn"}
    assert await manager.read_session("web:p") is None
    assert manager.get_or_create_transient("web:p", disabled_tools={"spawn"}) is private
    assert manager.get_or_create_transient("web:p").messages == []  # another policy: fresh


async def test_the_cache_is_bounded_in_rows_as_well_as_sessions(redis: aioredis.Redis) -> None:
    """A few long sessions cost the cache what many short ones do: the least recently
    used go while the cached rows are over the budget, counting rows a cached session
    gained since it was loaded."""
    manager = SessionManager(_store(redis), cache_size=100, cache_rows=10)
    for i in range(3):
        session = await manager.get_or_create(f"web:r{i}")
        for n in range(4):
            session.add_message("user", f"m{n}")
        await manager.save(session)  # 4 rows each
    assert manager.get_cached("web:r0") is None  # 12 rows > 10: the oldest went
    assert manager.get_cached("web:r2") is not None
    assert manager.get_cached("web:r1") is not None
    big = await manager.get_or_create("web:big")
    for n in range(20):
        big.add_message("user", f"b{n}")
    await manager.save(big)  # over the budget alone: kept (the newest), the rest went
    assert manager.get_cached("web:big") is big
    assert manager.get_cached("web:r1") is None
    assert manager.get_cached("web:r2") is None


async def _append_as_commit(redis: aioredis.Redis, key: str, rows: list[str], meta: str) -> int:
    """What commit.lua does to a hash: rows appended, count, meta, version + 1."""
    h = Keys().session(key)
    count = int(await redis.hget(h, "count") or 0)
    await redis.hset(h, mapping={f"m:{count + i}": r for i, r in enumerate(rows)})
    await redis.hset(h, mapping={"count": count + len(rows), "meta": meta})
    return int(await redis.hincrby(h, "version", 1))


async def test_a_copy_behind_by_a_few_turns_reads_only_what_it_lacks(
    redis: aioredis.Redis,
) -> None:
    """Consecutive turns of a session on different workers: the worker whose copy is a
    few versions old reads the head fields and the new rows, not the whole hash, and ends
    with what a full load gives."""
    import json

    from session_store.codec import encode_meta

    store = _store(redis)
    first = Session(key="web:d", scope="web/u")
    for i in range(500):
        first.add_message("user" if i % 2 == 0 else "assistant", f"m{i}")
    await store.save(first)
    behind = SessionManager(store)
    copy = await behind.load_for_turn("web:d", first.version, first.generation)
    assert len(copy.messages) == 500

    first.last_consolidated = 100
    first.metadata["title"] = "later"
    rows = [json.dumps({"role": "user", "content": f"new {i}"}) for i in range(3)]
    await _append_as_commit(redis, "web:d", rows[:1], encode_meta(first))
    version = await _append_as_commit(redis, "web:d", rows[1:], encode_meta(first))

    loads = 0
    full_load = store.load

    async def counting(key: str) -> Session | None:
        nonlocal loads
        loads += 1
        return await full_load(key)

    store.load = counting  # type: ignore[method-assign]
    got = await behind.load_for_turn("web:d", version, first.generation)
    assert loads == 0
    assert got is copy  # brought up to date in place
    truth = await full_load("web:d")
    assert truth is not None
    assert got.messages == truth.messages
    assert (got.version, got.generation, got.persisted_count) == (
        truth.version,
        truth.generation,
        503,
    )
    assert (got.last_consolidated, got.metadata, got.scope) == (100, {"title": "later"}, "web/u")
    assert [m["content"] for m in got.get_history(max_tokens=10)][-1] == "new 2"


async def test_a_rewritten_or_damaged_hash_is_loaded_whole(redis: aioredis.Redis) -> None:
    store = _store(redis)
    s = Session(key="web:r")
    s.add_message("user", "a")
    await store.save(s)
    behind = SessionManager(store)
    copy = await behind.load_for_turn("web:r", s.version, s.generation)
    old_gen = s.generation
    s.messages[0]["content"] = "rewritten"  # a rewrite (not an append): a new generation
    s.add_message("assistant", "b")
    await store.save(s)
    assert s.generation != old_gen
    got = await behind.load_for_turn("web:r", s.version, s.generation)
    assert got is not copy
    assert [m["content"] for m in got.messages] == ["rewritten", "b"]

    await redis.hset(Keys().session("web:r"), "m:0", "not json")  # a damaged row
    damaged = await store.load("web:r")
    assert damaged is not None
    assert [m["content"] for m in damaged.messages] == ["b"]
    version = await _append_as_commit(redis, "web:r", ['{"role":"user","content":"c"}'], "{}")
    assert await store.load_since(damaged)  # the next row is still the hash's third
    assert [m["content"] for m in damaged.messages] == ["b", "c"]
    assert damaged.version == version


async def test_a_copy_evicted_while_it_was_read_is_still_returned_and_cached(
    redis: aioredis.Redis,
) -> None:
    """Review: the key could leave the LRU during load_since's round trips (other loads,
    a discard); the turn must not fail on it."""
    store = _store(redis)
    s = Session(key="web:e")
    s.add_message("user", "a")
    await store.save(s)
    manager = SessionManager(store, cache_size=1)
    copy = await manager.load_for_turn("web:e", s.version, s.generation)
    version = await _append_as_commit(redis, "web:e", ['{"role":"user","content":"b"}'], "{}")
    real = store.load_since

    async def evicting(cached: Session, ahead: Ahead | None = None) -> bool:
        manager.invalidate("web:e")  # as a discard control does, mid-read
        return await real(cached, ahead)

    store.load_since = evicting  # type: ignore[method-assign]
    got = await manager.load_for_turn("web:e", version, s.generation)
    assert got is copy
    assert [m["content"] for m in got.messages] == ["a", "b"]
    assert manager.get_cached("web:e") is got


async def test_a_rewrite_of_a_damaged_hash_forgets_the_skipped_rows(redis: aioredis.Redis) -> None:
    """Review: after save() rewrote a hash that had an unreadable row, every row is one of
    the messages; the next delta read starts at the hash's next row."""
    store = _store(redis)
    s = Session(key="web:k")
    for text in ("r0", "r1", "r2"):
        s.add_message("user", text)
    await store.save(s)
    await redis.hset(Keys().session("web:k"), "m:1", "not json")
    damaged = await store.load("web:k")
    assert damaged is not None
    assert damaged.skipped_rows == 1
    await store.save(damaged)  # rewritten: r0, r2
    assert damaged.skipped_rows == 0
    rows = ['{"role":"user","content":"new-2"}', '{"role":"user","content":"new-3"}']
    await _append_as_commit(redis, "web:k", rows, "{}")
    assert await store.load_since(damaged)
    assert [m["content"] for m in damaged.messages] == ["r0", "r2", "new-2", "new-3"]


async def test_a_copy_far_behind_reads_every_row_it_lacks(redis: aioredis.Redis) -> None:
    """More rows than one read asks for ahead (ROWS_AHEAD): the rest in a second read,
    in order, none twice (over the worker's multiplexed connection on a real Redis)."""
    store = RedisSessionStore(redis, Keys(), fast=Multiplexed.for_client(redis))
    s = Session(key="web:far")
    s.add_message("user", "r0")
    await store.save(s)
    copy = await store.load("web:far")
    assert copy is not None
    rows = [f'{{"role":"user","content":"r{i}"}}' for i in range(1, ROWS_AHEAD + 11)]
    version = await _append_as_commit(redis, "web:far", rows, "{}")
    assert await store.load_since(copy)
    assert [m["content"] for m in copy.messages] == [f"r{i}" for i in range(ROWS_AHEAD + 11)]
    assert copy.version == version
    if store.fast is not None:
        await store.fast.aclose()


@pytest.mark.parametrize("appended", [0, 3, ROWS_AHEAD + 5])
async def test_acquire_reads_what_a_copy_behind_lacks_in_the_same_call(
    redis: aioredis.Redis, appended: int
) -> None:
    """Consecutive turns on different workers: the lease script returns the rows the
    taking worker's copy lacks, so the turn reads nothing more (beyond ROWS_AHEAD rows, only
    the rest); a current copy gets nothing extra; the result is what a full load gives.
    A lease that selects no entry (nothing queued) reads no rows."""
    bus = RedisBus(redis)
    await bus.scripts.load_all()
    store = RedisSessionStore(redis, Keys(), fast=bus.fast)
    s = Session(key="web:acq", scope="web/u")
    for i in range(10):
        s.add_message("user", f"m{i}")
    await store.save(s)
    manager = SessionManager(store)
    copy = await manager.load_for_turn("web:acq", s.version, s.generation)
    rows = [f'{{"role":"user","content":"new {i}"}}' for i in range(appended)]
    if rows:
        await _append_as_commit(redis, "web:acq", rows, '{"last_consolidated": 4}')

    cached = manager.cached_for_acquire("web:acq")
    idle = await bus.acquire("web:acq", "w2", member="web:acq", cached=cached)
    assert isinstance(idle, Acquired)
    assert isinstance(idle.step, Released)
    assert idle.ahead is None  # no turn runs: nothing read for it
    await FrontendClient(redis).send(
        InboundMessage(channel="web", sender_id="u", chat_id="acq", content="next")
    )
    got = await bus.acquire("web:acq", "w2", member="web:acq", cached=cached)
    assert isinstance(got, Acquired)
    assert isinstance(got.step, Entry)
    assert (got.ahead is None) == (appended == 0)
    if got.ahead is not None:  # exactly the rows it lacks, up to ROWS_AHEAD: none past the end
        assert len(got.ahead.rows) == min(appended, ROWS_AHEAD)
        assert all(r is not None for r in got.ahead.rows)
    reads: list[list[str]] = []
    real_hmget, real_load = store._hmget, store.load

    async def hmget(key: str, fields: list[str]) -> list[object]:
        reads.append(fields)
        return await real_hmget(key, fields)

    async def load(key: str) -> Session | None:
        raise AssertionError("a copy behind by a few turns is never loaded whole")

    store._hmget, store.load = hmget, load  # type: ignore[method-assign]
    session = await manager.load_for_turn("web:acq", got.version, got.generation, got.ahead)
    assert session is copy
    expected = (
        []
        if appended <= ROWS_AHEAD
        else [[f"m:{i}" for i in range(10 + ROWS_AHEAD, 10 + appended)]]
    )
    assert reads == expected
    store._hmget, store.load = real_hmget, real_load  # type: ignore[method-assign]
    truth = await store.load("web:acq")
    assert truth is not None
    assert session.messages == truth.messages
    assert (session.version, session.persisted_count) == (truth.version, 10 + appended)
    if appended:
        assert session.last_consolidated == 4
    await bus.release("web:acq", got.token)
    await bus.aclose()


async def test_acquire_gives_nothing_ahead_for_another_generation(redis: aioredis.Redis) -> None:
    """A session deleted and re-created (or rewritten) since the copy was cached: acquire
    reads no rows for it, and the turn loads the new hash whole."""
    bus = RedisBus(redis)
    await bus.scripts.load_all()
    store = RedisSessionStore(redis, Keys(), fast=bus.fast)
    s = Session(key="web:gen")
    s.add_message("user", "old")
    await store.save(s)
    manager = SessionManager(store)
    await manager.load_for_turn("web:gen", s.version, s.generation)
    fresh = Session(key="web:gen")
    fresh.add_message("user", "new")
    fresh.add_message("assistant", "newer")
    await store.save(fresh)  # another generation
    await FrontendClient(redis).send(
        InboundMessage(channel="web", sender_id="u", chat_id="gen", content="next")
    )
    got = await bus.acquire(
        "web:gen", "w2", member="web:gen", cached=manager.cached_for_acquire("web:gen")
    )
    assert isinstance(got, Acquired)
    assert got.ahead is None
    session = await manager.load_for_turn("web:gen", got.version, got.generation, got.ahead)
    assert [m["content"] for m in session.messages] == ["new", "newer"]
    await bus.release("web:gen", got.token)
    await bus.aclose()
