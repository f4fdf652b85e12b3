"""The Lua scripts on fakeredis and on a real redis-server: each one runs, fencing,
idempotency, the release-vs-new-message race, control markers, acknowledgement inside
acquire."""

from __future__ import annotations

import json

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from bus_redis import FrontendClient, InboundMessage, Keys, RedisBus
from bus_redis.codec import fields
from bus_redis.queue import WORKER_GROUP
from bus_redis.results import (
    Acquired,
    Busy,
    CommitSpec,
    ControlReached,
    Entry,
    Forward,
    Lost,
    More,
    Notification,
    Private,
    Released,
)
from bus_redis.scripts import SCRIPT_NAMES, Scripts
from bus_redis.streams import Retention

K = "web:s"


async def test_every_script_runs(redis: aioredis.Redis) -> None:
    """Each script is executed (fakeredis only hashes a script on SCRIPT LOAD, so loading
    alone would check nothing there)."""
    bus = RedisBus(redis)
    k = bus.keys
    scripts = Scripts(redis)
    stream = [
        k.inbound(K),
        k.attempts(K),
        k.control_hint(K),
        k.owner(K),
        k.ready("web"),
        k.lease(K),
        k.queued("web"),
    ]
    calls = {
        "acquire": ([k.lease(K), k.pending(K), k.session(K), k.session(K), k.owner(K), k.lease(K), k.leases("web"), k.lease(K), k.lease(K), k.pending(K), *stream],
                    ["w", 1000, K, K, "0", 1000, "1", "n", 100, "", "workers", 0, 0, "", 0, K]),
        "next": ([k.lease(K), k.pending(K), k.leases("web"), *stream], ["n|w", K, 100, K]),
        "commit": ([k.lease(K), k.session(K), *stream[:2], k.out(K), k.sessions_index("web"),
                    k.sessions_index("web"), k.owner(K), k.owners("web"), k.pending(K), k.dead("web"),
                    k.leases("web"), k.journal(K), k.pulse("web")],
                   ["n|w", "", "", 100, 1000, "", K, "", "w", "", 1000, "", "0j", "g", "", 0]),
        "release": ([k.lease(K), k.pending(K), k.ready("web"), k.leases("web")], ["n|w", K, 100]),
        "hold": ([k.lease(K), k.leases("web")], ["n|admin", 1000, K]),
        "renew": ([k.lease(K), k.pending(K), k.leases("web")], ["x", 1000, K]),
        "sweep": ([k.leases("web"), k.ready("web")], [100, 100]),
        "emit": ([k.lease(K), k.out(K), k.pulse("web")], ["x", "{}", 100, 1000]),
        "owner": ([k.owner(K), k.owners("web"), k.out(K), k.private_mark(K)],
                  ["renew", "w", "m", 1000, 0]),
        "owner_lost": ([k.owner(K), k.owners("web"), k.out(K), k.ready("web"), k.pulse("web")],
                       ["m", "{}", K, 100, 1000]),
        "consolidate": ([k.lease(K), k.session(K), k.memory("web/a"), k.memory_history("web/a")],
                        ["x", "{}", 0, "s", 0, "h", 100, 0]),
        "delete": (k.deletion(K, k.lease(K), ""), ["x", K]),
        "journal": ([k.lease(K), k.journal(K)], ["x", f"{K}|1-1", 1000, "{}"]),
        "cron_add": ([k.lease(K), k.cron_defs("web"), k.cron_due("web"), k.crons(K)],
                     ["x", "c1", "{}", 1000, 10, 100]),
        "cron_remove": ([k.cron_defs("web"), k.cron_due("web"), k.crons(K), k.lease(K)],
                        ["c1", "x"]),
        "cron_fire": ([k.cron_defs("web"), k.cron_due("web"), k.crons(K), k.inbound(K),
                       k.queued("web"), k.ready("web"), k.session(K), k.lease(K),
                       k.journal(K)],
                      ["c1", 1000, "{}", "", K, 100]),
        "spawn_add": ([k.lease(K), k.spawned(K), k.subagents("web")],
                      ["x", "s1", "{}", 3, 1000, K, 64]),
        "spawn_done": ([k.spawned(K), k.subagents("web"), k.inbound(K), k.queued("web"),
                        k.ready("web"), k.lease(K)], ["s1", "done", "{}", K, 100, ""]),
        "markers": (stream[:3], ["1-1", ""]),
        "interrupts": ([k.inbound(K)], ["1-1", "1-1", 64]),
        "compact": ([k.lease(K), k.out(K)], ["x", 64]),
        "hint": ([k.control_hint(K), k.inbound(K)], []),
        "tidy": ([*stream[:3], k.lease(K), k.owner(K), k.queued("web")], [K]),
        "beat": ([k.alive], ["w"]),
        "claim": ([k.worker_info("w"), k.workers], ["w", "", "n", "h", 1, 1000, 1]),
        "heartbeat": ([k.worker_info("w"), k.workers, k.mode], ["w", "n", 1000, "per-session", "pid", "1"]),
        "dead": ([k.alive], [1000, 16, 60000]),
        "takeover": ([k.lease(K), k.leases("web"), k.ready("web"), k.alive],
                     ["n|w", K, 100, "w", 800]),
    }  # fmt: skip
    assert set(calls) == set(SCRIPT_NAMES)
    for name, (keys, args) in calls.items():
        await scripts.call(name, keys, args)  # a Lua error (or a missing key) raises here


async def _queued(redis: aioredis.Redis, *texts: str, chat: str = "s") -> RedisBus:
    client = FrontendClient(redis)
    for t in texts:
        await client.send(InboundMessage(channel="web", sender_id="u", chat_id=chat, content=t))
    return RedisBus(redis, lock_ttl_ms=5000)


async def test_acquire_selects_then_commit_releases_when_empty(redis: aioredis.Redis) -> None:
    bus = await _queued(redis, "one")
    got = await bus.acquire(K, "w1", member=K)
    assert isinstance(got, Acquired)
    assert isinstance(got.step, Entry)
    assert isinstance(await bus.acquire(K, "w2", member=K), Busy)
    await redis.incr(bus.keys.control_hint(K))  # a hint with no marker behind it (careless)

    spec = CommitSpec(member=K, entry_ids=[got.step.entry_id], meta="{}", rows=['{"role":"user"}'])
    version, gen, step = await bus.commit(K, got.token, "w1", spec, select=[K])
    assert version == 1
    assert gen
    assert isinstance(step, Released)
    left = [bus.keys.lease(K), bus.keys.inbound(K), bus.keys.pending(K), bus.keys.attempts(K)]
    left.append(bus.keys.control_hint(K))  # the emptied stream goes with its hint
    assert not await redis.exists(*left)
    assert await redis.zscore(bus.keys.queued("web"), K) is None
    assert await redis.zscore(bus.keys.leases("web"), K) is None


async def test_a_dead_letter_over_junk_at_its_key_still_commits_whole(
    redis: aioredis.Redis,
) -> None:
    """A careless operator left a string where a channel's dead letters go: the commit that
    dead-letters an entry replaces it instead of failing after the rows and the entry's
    deletion were written (a retry would then find the commit applied and never write the
    dead letter)."""
    bus = await _queued(redis, "poison")
    await redis.set(bus.keys.dead("web"), "an operator's note")
    got = await bus.acquire(K, "w1", member=K)
    assert isinstance(got, Acquired)
    assert isinstance(got.step, Entry)
    spec = CommitSpec(
        member=K, entry_ids=[got.step.entry_id], meta="{}", rows=['{"role":"user"}'],
        reply='{"type":"error"}', dead='{"reason":"poison"}',
    )  # fmt: skip
    version, _gen, step = await bus.commit(K, got.token, "w1", spec, select=[K])
    assert (version, isinstance(step, Released)) == (1, True)
    dead = await redis.xrange(bus.keys.dead("web"))
    assert [fields(f)["entry"] for _, f in dead] == ['{"reason":"poison"}']
    assert len(await redis.xrange(bus.keys.out(K))) == 1


async def test_a_commit_of_many_rows_stores_each_once_after_the_rest(
    redis: aioredis.Redis,
) -> None:
    """Rows and the head go in one HSET, in chunks past 500 rows (Lua's unpack limit)."""
    bus = await _queued(redis, "one", "two")
    first = await bus.acquire(K, "w1", member=K)
    assert isinstance(first, Acquired)
    assert isinstance(first.step, Entry)
    spec = CommitSpec(member=K, entry_ids=[first.step.entry_id], meta="{}", rows=['{"r":0}'])
    _, gen, second = await bus.commit(K, first.token, "w1", spec, select=[K])
    assert isinstance(second, Entry)
    rows = [f'{{"r":{i}}}' for i in range(1, 1201)]
    spec = CommitSpec(member=K, entry_ids=[second.entry_id], meta='{"m":1}', rows=rows)
    version, gen2, _ = await bus.commit(K, first.token, "w1", spec, select=[K])
    h = await redis.hgetall(bus.keys.session(K))
    assert (version, gen2, h["count"], h["meta"]) == (2, gen, "1201", '{"m":1}')
    assert [h[f"m:{i}"] for i in range(1201)] == ['{"r":0}', *rows]


async def test_commit_is_idempotent_under_a_client_retry(redis: aioredis.Redis) -> None:
    bus = await _queued(redis, "one", "two")
    got = await bus.acquire(K, "w1", member=K)
    assert isinstance(got, Acquired)
    assert isinstance(got.step, Entry)
    spec = CommitSpec(
        member=K, entry_ids=[got.step.entry_id], meta="{}", rows=['{"r":1}'], reply='{"x":1}'
    )
    await bus.commit(K, got.token, "w1", spec, select=None)
    await bus.commit(K, got.token, "w1", spec, select=None)  # the retry

    assert await redis.hget(bus.keys.session(K), "count") == "1"
    assert await redis.xlen(bus.keys.out(K)) == 1
    assert 0 < await redis.pttl(bus.keys.out(K)) <= bus.retention.ttl_ms  # kept, bounded
    assert await redis.xlen(bus.keys.inbound(K)) == 1  # "two" is still queued


@pytest.mark.parametrize("select", [None, "other stream"])
async def test_a_commit_that_keeps_the_lease_keeps_the_streams_last_id(
    redis: aioredis.Redis, select: str | None
) -> None:
    """Only a commit that releases S deletes it at once: a stream the lease keeps (no
    selection at shutdown, or another stream selected) keeps its last id, so a frontend's
    explicit id can never go back to the processed entry's (a retried commit would take
    that new message for the processed one)."""
    bus = await _queued(redis, "one")
    got = await bus.acquire(K, "w1", member=K)
    assert isinstance(got, Acquired)
    assert isinstance(got.step, Entry)
    streams = None if select is None else [K, "web:t"]
    if streams is not None:
        await _queued(redis, "x", chat="t")
        await redis.sadd(bus.keys.pending(K), "web:t")
    spec = CommitSpec(member=K, entry_ids=[got.step.entry_id], meta="{}", rows=['{"r":1}'])
    _, _, step = await bus.commit(K, got.token, "w1", spec, select=streams)
    if streams is not None:
        assert isinstance(step, Entry)
        assert step.member == "web:t"
    with pytest.raises(ResponseError, match="equal or smaller"):
        await redis.xadd(bus.keys.inbound(K), {"payload": "x"}, id=got.step.entry_id)


async def test_a_stale_token_writes_nothing(redis: aioredis.Redis) -> None:
    bus = await _queued(redis, "one")
    got = await bus.acquire(K, "w1", member=K)
    assert isinstance(got, Acquired)
    assert isinstance(got.step, Entry)
    await redis.delete(bus.keys.lease(K))  # the lease expired
    again = await bus.acquire(K, "w1", member=K)  # even the same worker gets a new token
    assert isinstance(again, Acquired)
    assert again.token != got.token

    spec = CommitSpec(
        member=K, entry_ids=[got.step.entry_id], meta="{}", rows=['{"r":1}'], reply="{}"
    )
    assert await bus.commit(K, got.token, "w1", spec, select=[K]) == (-1, "", Lost())
    assert not await bus.renew(K, got.token)
    assert not await bus.emit(K, got.token, K, "{}", transient=False)
    assert (
        await bus.consolidate(
            K,
            got.token,
            meta="{}",
            version=0,
            scope="web/a",
            memory="s",
            memory_version=0,
            history="h",
        )
        == "lost"
    )
    memory, history = bus.keys.memory("web/a"), bus.keys.memory_history("web/a")
    assert not await redis.exists(bus.keys.session(K), bus.keys.out(K), memory, history)
    assert await redis.xlen(bus.keys.inbound(K)) == 1


async def test_a_consolidation_over_junk_at_the_archive_key_writes_everything(
    redis: aioredis.Redis,
) -> None:
    """A careless operator left a string where a scope's history archive goes: the
    consolidation replaces it instead of failing after the memory moved (its archive entry
    would be lost for good: a retry finds the memory moved)."""
    bus = await _queued(redis, "one")
    got = await bus.acquire(K, "w1", member=K)
    assert isinstance(got, Acquired)
    memory, history = bus.keys.memory("web/a"), bus.keys.memory_history("web/a")
    await redis.set(history, "an operator's note")
    done = await bus.consolidate(
        K, got.token, meta='{"last_consolidated":0}', version=0, scope="web/a", memory="facts",
        memory_version=0, history="what was folded",
    )  # fmt: skip
    assert done == "ok"
    assert await redis.hget(memory, "content") in ("facts", b"facts")
    assert [fields(f)["entry"] for _, f in await redis.xrange(history)] == ["what was folded"]


async def test_the_archive_keeps_no_entry_longer_than_an_idle_session(
    redis: aioredis.Redis,
) -> None:
    """A scope's archive holds old rows' text: each append drops entries older than the
    session retention and the archive expires that long after its last append; with
    retention off (0) nothing is dropped."""
    history = Keys().memory_history("web/a")
    for keep_ms, left in ((0, ["long ago", "what was folded"]), (60_000, ["what was folded"])):
        await redis.delete(history, Keys().session(K), Keys().memory("web/a"))
        await redis.xadd(history, {"entry": "long ago"}, id="1000-0")
        bus = await _queued(redis, "one")
        bus.retention = Retention(session_ttl_ms=keep_ms)
        got = await bus.acquire(K, "w1", member=K)
        assert isinstance(got, Acquired)
        done = await bus.consolidate(
            K, got.token, meta='{"last_consolidated":0}', version=0, scope="web/a",
            memory="facts", memory_version=0, history="what was folded",
        )  # fmt: skip
        assert done == "ok"
        assert [fields(f)["entry"] for _, f in await redis.xrange(history)] == left
        ttl = await redis.pttl(history)
        assert ttl == -1 if keep_ms == 0 else 0 < ttl <= keep_ms
        await bus.release(K, got.token)


async def test_a_message_arriving_during_release_keeps_the_lease(redis: aioredis.Redis) -> None:
    bus = await _queued(redis, "one")
    got = await bus.acquire(K, "w1", member=K)
    assert isinstance(got, Acquired)
    assert isinstance(got.step, Entry)
    # another stream of the same effective key is notified while we work
    await _queued(redis, "x", chat="t")
    assert isinstance(await bus.acquire(K, "w2", member="web:t"), Busy)

    spec = CommitSpec(member=K, entry_ids=[got.step.entry_id])
    _, _, step = await bus.commit(K, got.token, "w1", spec, select=[K])
    assert step == More(("web:t",))
    step = await bus.next(K, got.token, [K, "web:t"])
    assert isinstance(step, Entry)
    assert step.member == "web:t"


async def test_transient_owner_gets_the_forward(redis: aioredis.Redis) -> None:
    bus = await _queued(redis, "private")
    got = await bus.acquire(K, "owner", member=K, claim_owner=True, select=False)
    assert isinstance(got, Acquired)
    assert await bus.release(K, got.token)
    assert await bus.acquire(K, "other", member=K) == Forward("owner")
    assert not await redis.exists(bus.keys.pending(K))  # K is its own stream: none kept
    assert await bus.acquire("unified:default", "other", member=K) == Private()
    owned = await bus.acquire(K, "owner", member=K, claim_owner=True)
    assert isinstance(owned, Acquired)
    assert isinstance(owned.step, Entry)  # the forwarded entry, read from S itself
    assert json.loads(owned.step.payload)["content"] == "private"


async def test_a_stop_marker_covers_exactly_the_messages_before_it(redis: aioredis.Redis) -> None:
    bus = await _queued(redis, "before-1", "before-2")
    await FrontendClient(redis).stop(K)
    await _queued(redis, "after")
    got = await bus.acquire(K, "w1", member=K)
    assert isinstance(got, Acquired)
    steps = [got.step]
    while isinstance(steps[-1], Entry):
        entry = steps[-1]
        spec = CommitSpec(member=K, entry_ids=[entry.entry_id])
        steps.append((await bus.commit(K, got.token, "w1", spec, select=[K]))[2])
    covered = [
        (json.loads(s.payload)["content"], s.covered_by) for s in steps if isinstance(s, Entry)
    ]
    assert covered == [("before-1", "stop"), ("before-2", "stop"), ("after", "")]
    assert isinstance(steps[-1], Released)
    assert not await redis.exists(bus.keys.control_hint(K), bus.keys.inbound(K))


async def test_a_discard_marker_reached_at_the_head_is_reported(redis: aioredis.Redis) -> None:
    bus = await _queued(redis)
    await FrontendClient(redis).discard(K)
    got = await bus.acquire(K, "w1", member=K)
    assert isinstance(got, Acquired)
    assert got.step == ControlReached(K, "discard")
    assert isinstance(await bus.next(K, got.token, [K]), Released)


async def test_a_delete_marker_outlives_a_holder_killed_before_it_deleted(
    redis: aioredis.Redis,
) -> None:
    """A delete marker reached at the head stays there until the holder's next call after
    the deletion: a holder killed in between (its lease taken over or run out) leaves it
    to the next holder, who deletes the stored chat (before: the marker was consumed when
    reached, and the chat stayed stored for good)."""
    from session_store import RedisSessionStore

    bus = await _queued(redis, "hello")
    got = await bus.acquire(K, "w1", member=K)
    assert isinstance(got, Acquired)
    assert isinstance(got.step, Entry)
    spec = CommitSpec(member=K, entry_ids=[got.step.entry_id], meta="{}", rows=['{"r":0}'])
    await bus.commit(K, got.token, "w1", spec, select=[K])
    assert await redis.exists(bus.keys.session(K))
    await FrontendClient(redis).delete(K)
    held = await bus.acquire(K, "w1", member=K)
    assert isinstance(held, Acquired)
    assert isinstance(held.step, ControlReached)
    assert (held.step.op, held.step.attempts) == ("delete", 1)
    await redis.delete(bus.keys.lease(K))  # kill -9 of w1 before it deleted; lease gone
    await _queued(redis, "after the delete")
    again = await bus.acquire(K, "w2", member=K)
    assert isinstance(again, Acquired)
    assert again.step == ControlReached(K, "delete", held.step.marker, 2)
    store = RedisSessionStore(redis, bus.keys)
    assert await store.delete_held(K, bus.keys.lease(K), again.token) == 1
    after = await bus.next(K, again.token, [K], done=again.step)
    assert isinstance(after, Entry)  # the message sent after the delete, now
    assert json.loads(after.payload)["content"] == "after the delete"
    assert not await redis.exists(bus.keys.session(K))
    assert not await redis.exists(bus.keys.control_hint(K))  # the marker counted no more
    assert not await redis.hexists(bus.keys.attempts(K), held.step.marker)


async def test_of_a_run_of_markers_the_last_delete_is_kept_and_consumed_once(
    redis: aioredis.Redis,
) -> None:
    """discard, new, delete, new at the head: the discard and the first new are consumed
    (the delete does what they do), the delete is kept until the holder's next call, which
    consumes it (a client retry of that call consumes nothing more); then the last new."""
    bus = await _queued(redis)
    client = FrontendClient(redis)
    for op in ("discard", "new", "delete", "new"):
        await client.control(op, K)
    got = await bus.acquire(K, "w1", member=K)
    assert isinstance(got, Acquired)
    assert isinstance(got.step, ControlReached)
    assert (got.step.op, got.step.attempts) == ("delete", 1)
    assert await redis.xlen(bus.keys.inbound(K)) == 2  # the delete and the last new
    step = await bus.next(K, got.token, [K], done=got.step)
    assert isinstance(step, ControlReached)
    assert (step.op, step.attempts) == ("new", 1)
    retried = await bus.next(K, got.token, [K], done=got.step)  # a client retry: the
    assert retried == ControlReached(K, "new", step.marker, 2)  # delete is gone already
    assert int(await redis.get(bus.keys.control_hint(K)) or 0) == 1
    assert isinstance(await bus.next(K, got.token, [K], done=step), Released)
    assert not await redis.exists(bus.keys.inbound(K), bus.keys.control_hint(K))


async def test_of_a_run_of_news_only_the_last_is_kept(redis: aioredis.Redis) -> None:
    """new, new, new at the head: the first two are consumed (the last does what they do),
    so each call reads the run once instead of re-reading the markers left behind the one
    kept; the message after them comes next."""
    bus = await _queued(redis)
    client = FrontendClient(redis)
    for op in ("new", "new", "new"):
        await client.control(op, K)
    await _queued(redis, "after the news")
    got = await bus.acquire(K, "w1", member=K)
    assert isinstance(got, Acquired)
    assert isinstance(got.step, ControlReached)
    assert (got.step.op, got.step.attempts) == ("new", 1)
    assert await redis.xlen(bus.keys.inbound(K)) == 2  # the last new and the message
    assert int(await redis.get(bus.keys.control_hint(K)) or 0) == 1
    after = await bus.next(K, got.token, [K], done=got.step)
    assert isinstance(after, Entry)
    assert json.loads(after.payload)["content"] == "after the news"


async def test_a_release_consumes_the_marker_its_holder_acted_on(redis: aioredis.Redis) -> None:
    """A holder that gives S up right after a delete's effect (unified mode: S's private
    session ended) consumes the kept marker in the release, fenced, and S is re-notified
    for the message after it."""
    bus = await _queued(redis)
    await FrontendClient(redis).delete(K)
    await _queued(redis, "after the delete")
    got = await bus.acquire(K, "w1", member=K)
    assert isinstance(got, Acquired)
    assert isinstance(got.step, ControlReached)
    ready = await redis.xlen(bus.keys.ready("web"))
    assert not await bus.release(K, "other|w2", done=got.step)  # not ours: nothing done
    assert await redis.xlen(bus.keys.inbound(K)) == 2
    assert await bus.release(K, got.token, done=got.step)
    assert await redis.xlen(bus.keys.inbound(K)) == 1  # the message, re-notified
    assert await redis.xlen(bus.keys.ready("web")) == ready + 1
    assert not await redis.exists(bus.keys.control_hint(K), bus.keys.lease(K))
    assert not await redis.hexists(bus.keys.attempts(K), got.step.marker)


async def test_acquire_acknowledges_its_notification_itself(redis: aioredis.Redis) -> None:
    await _queued(redis, "one")
    bus = RedisBus(redis)
    streams = bus.note_streams("w1", ["web"])
    await bus.ensure_groups(streams)
    notes = await bus.read_notifications("w1", streams, count=10, block_ms=10)
    assert [n.session_key for n in notes] == [K]
    assert isinstance(await bus.acquire(K, "w1", member=K, note=notes[0]), Acquired)
    assert await redis.xlen(bus.keys.ready("web")) == 0
    assert (await redis.xpending(bus.keys.ready("web"), "workers"))["pending"] == 0


@pytest.mark.real_redis
async def test_a_failed_acquire_leaves_its_notification_pending(real_redis: aioredis.Redis) -> None:
    """Over maxmemory the script fails before its acknowledgement: the notification stays
    pending and is redelivered (XAUTOCLAIM) once memory is back."""
    await _queued(real_redis, "one")
    bus = RedisBus(real_redis)
    streams = bus.note_streams("w1", ["web"])
    await bus.ensure_groups(streams)
    note = (await bus.read_notifications("w1", streams, count=10, block_ms=10))[0]
    used = int((await real_redis.info("memory"))["used_memory"])
    await real_redis.config_set("maxmemory", str(used - 1024))
    try:
        with pytest.raises(ResponseError, match="maxmemory"):
            await bus.acquire(K, "w1", member=K, note=note)
    finally:
        await real_redis.config_set("maxmemory", "0")
    assert (await real_redis.xpending(bus.keys.ready("web"), "workers"))["pending"] == 1
    again = await bus.claim_stale("w2", streams, min_idle_ms=0)
    assert [n.session_key for n in again] == [K]
    assert isinstance(await bus.acquire(K, "w2", member=K, note=again[0]), Acquired)


async def test_a_notification_for_another_channel_is_dropped(redis: aioredis.Redis) -> None:
    bus = RedisBus(redis)
    streams = bus.note_streams("w1", ["web"])
    await bus.ensure_groups(streams)
    await redis.xadd(bus.keys.ready("web"), {"session": "telegram:alice"})  # forged
    await redis.xadd(bus.keys.ready("web"), {"session": "web:ok"})
    notes = await bus.read_notifications("w1", streams, count=10, block_ms=10)
    assert [n.session_key for n in notes] == ["web:ok"]
    assert await redis.xlen(bus.keys.ready("web")) == 1  # the forged one is gone
    assert notes[0] == Notification(bus.keys.ready("web"), notes[0].entry_id, "web:ok")


async def test_an_expired_lease_is_swept_back_onto_its_channels_queue(
    redis: aioredis.Redis,
) -> None:
    """A holder that died keeps nobody waiting longer than its lease."""
    from bus_redis.registry import Registry

    bus = await _queued(redis, "one")
    got = await bus.acquire(K, "dead", member=K)
    assert isinstance(got, Acquired)
    assert await Registry(bus).sweeps.leases(["web"]) == []  # alive: nothing to do
    await redis.delete(bus.keys.lease(K))  # its lease ran out
    await redis.zadd(bus.keys.leases("web"), {K: 1})
    assert await Registry(bus).sweeps.leases(["web"]) == [K]
    last = await redis.xrevrange(bus.keys.ready("web"), count=1)
    # the re-notified key is its own stream (nothing is folded under it): a plain
    # notification of it, which a worker of any version serves by reading the stream
    assert last[0][1] == {"session": K}
    again = await bus.acquire(K, "w2", member=K)
    assert isinstance(again, Acquired)
    assert isinstance(again.step, Entry)


async def test_a_release_without_a_commit_renotifies_a_key_whose_stream_holds_entries(
    redis: aioredis.Redis,
) -> None:
    """A lease held without running a turn (an admin's delete, a blocking acquire) answers
    a notification busy; a key that is its own stream keeps no pending set, so the release
    re-notifies it when its stream holds entries, and not when it holds none."""
    bus = RedisBus(redis, lock_ttl_ms=5000)
    ready = bus.keys.ready("web")
    held = await bus.acquire(K, "admin", select=False)
    assert isinstance(held, Acquired)
    assert await bus.release(K, held.token)
    assert await redis.xlen(ready) == 0  # nothing queued: nobody is woken

    held = await bus.acquire(K, "admin", select=False)
    assert isinstance(held, Acquired)
    await _queued(redis, "arrives meanwhile")
    streams = bus.note_streams("w1", ["web"])
    await bus.ensure_groups(streams)
    notes = await bus.read_notifications("w1", streams, count=10, block_ms=10)
    assert isinstance(await bus.acquire(K, "w1", member=K, note=notes[0]), Busy)
    assert await redis.xlen(ready) == 0  # answered busy: acknowledged and gone
    assert await bus.release(K, held.token)
    again = await bus.read_notifications("w1", streams, count=10, block_ms=10)
    assert [(n.session_key, n.effective) for n in again] == [(K, False)]
    got = await bus.acquire(K, "w1", member=K, note=again[0])
    assert isinstance(got, Acquired)
    assert isinstance(got.step, Entry)


async def test_an_admin_hold_is_swept_like_a_turn_s_lease_when_its_holder_dies(
    redis: aioredis.Redis,
) -> None:
    """`sessions delete` and the idle prune hold a lease without a turn: it enters the
    lease registry, so that a message answered busy meanwhile is re-notified by the lease
    sweep one TTL after the holder died; a release takes it out."""
    from bus_redis.registry import Registry
    from session_store import RedisSessionStore

    bus = await _queued(redis)
    store = RedisSessionStore(redis, bus.keys, lock_ttl_ms=5000)
    lease = bus.keys.lease(K)
    assert await store._hold(K, lease, "t|admin")
    assert not await store._hold(K, lease, "u|admin")  # one holder
    assert await redis.zscore(bus.keys.leases("web"), K) is not None
    await redis.delete(lease)  # the admin process died; its lease ran out
    await redis.zadd(bus.keys.leases("web"), {K: 1})
    assert await Registry(bus).sweeps.leases(["web"]) == [K]
    assert await store.delete(K) is False  # nothing stored: held, then released
    assert await redis.zscore(bus.keys.leases("web"), K) is None


async def test_delete_and_prune_hold_the_lease_in_the_registry(redis: aioredis.Redis) -> None:
    """What `sessions delete` and the idle prune do under the lease, they do with the
    lease entered in the registry (``hold.lua``), and leave none behind."""
    from session_store import RedisSessionStore

    bus = await _queued(redis)
    store = RedisSessionStore(redis, bus.keys, lock_ttl_ms=5000)
    registry = bus.keys.leases("web")
    seen: list[float | None] = []

    async def delete_held(key: str, lease: str, token: str) -> int:
        seen.append(await redis.zscore(registry, key))
        return 0

    store.delete_held = delete_held  # type: ignore[method-assign]
    await store.delete(K)
    await redis.zadd(bus.keys.sessions_index("web"), {K: 1})  # idle since long ago
    assert await store.prune_idle("web", 1000) == []
    assert len(seen) == 2
    assert all(score is not None for score in seen)
    assert await redis.zscore(registry, K) is None


async def test_a_busy_answer_names_the_stream_for_a_release_that_does_not(
    redis: aioredis.Redis,
) -> None:
    """A rolling upgrade: a process from before the pending set was dropped for keys that
    are their own stream (an admin tool, a worker) holds K = S without a turn, and its
    release names no stream (4 KEYS): the notification answered busy meanwhile put S in
    K's pending set, so that release still re-notifies K. Nothing joins the set on a turn's
    own acquire."""
    bus = RedisBus(redis, lock_ttl_ms=5000)
    held = await bus.acquire(K, "old", select=False)
    assert isinstance(held, Acquired)
    await _queued(redis, "arrives during the hold")
    streams = bus.note_streams("w1", ["web"])
    await bus.ensure_groups(streams)
    notes = await bus.read_notifications("w1", streams, count=10, block_ms=10)
    assert isinstance(await bus.acquire(K, "w1", member=K, note=notes[0]), Busy)
    assert await redis.smembers(bus.keys.pending(K)) == {K}
    assert 0 < await redis.pttl(bus.keys.pending(K)) <= 10_000
    old_keys = bus.keys.release(K, bus.keys.lease(K))[:4]  # as the release before it
    assert await bus.scripts.call("release", old_keys, [held.token, K, 1000]) == 1
    again = await bus.read_notifications("w1", streams, count=10, block_ms=10)
    assert [n.session_key for n in again] == [K]
    got = await bus.acquire(K, "w1", member=K, note=again[0])
    assert isinstance(got, Acquired)
    assert isinstance(got.step, Entry)
    spec = CommitSpec(member=K, entry_ids=[got.step.entry_id], meta="{}", rows=['{"r":0}'])
    _, _, step = await bus.commit(K, got.token, "w1", spec, select=[K])
    assert isinstance(step, Released)
    assert not await redis.exists(bus.keys.pending(K))  # gone with the release


async def test_a_release_naming_the_stream_leaves_no_busy_note_behind(
    redis: aioredis.Redis,
) -> None:
    """(Found by tests/test_control_sequences.py, unified mode.) A release that names S
    notifies S itself when S holds entries, so the busy answer's note of S in K's pending
    set is done with: it stayed for two lease terms (a private session's holder handing S
    over to the unified key once its session ended), a key left behind each time."""
    bus = RedisBus(redis, lock_ttl_ms=5000)
    streams = bus.note_streams("w1", ["web"])
    await bus.ensure_groups(streams)
    for queued in (True, False):
        held = await bus.acquire(K, "admin", select=False)
        assert isinstance(held, Acquired)
        await _queued(redis, "arrives during the hold")
        notes = await bus.read_notifications("w1", streams, count=10, block_ms=10)
        assert isinstance(await bus.acquire(K, "w1", member=K, note=notes[0]), Busy)
        assert await redis.smembers(bus.keys.pending(K)) == {K}
        if not queued:
            await redis.delete(bus.keys.inbound(K))  # (drained by another holder meanwhile)
        assert await bus.release(K, held.token)
        assert not await redis.exists(bus.keys.pending(K))
        again = await bus.read_notifications("w1", streams, count=10, block_ms=10)
        assert [n.session_key for n in again] == ([K] if queued else [])
        for note in again:
            await redis.xack(note.stream, WORKER_GROUP, note.entry_id)
        await redis.delete(bus.keys.inbound(K))


@pytest.mark.real_redis
async def test_a_full_redis_loses_no_event_of_a_private_session_s_commit() -> None:
    """At maxmemory (noeviction), a private session's commit (no rows: the deletion of the
    processed entry is its first write, which Redis lets past the limit) keeps the events
    a reader has not read yet and adds the answer: an out-of-memory error is no junk that
    ``safe`` may delete."""
    from servers import RedisServer, require_redis_server

    from bus_redis.results import CommitSpec

    require_redis_server()
    server = RedisServer(extra=["--maxmemory-policy", "noeviction"]).start()
    redis = aioredis.from_url(server.url, decode_responses=True)
    try:
        bus = RedisBus(redis)
        await bus.scripts.load_all()
        s = "web:private"
        await redis.xadd(bus.keys.out(s), {"payload": "earlier, not yet read"})
        entry = await redis.xadd(bus.keys.inbound(s), {"payload": "{}"})
        acquired = await bus.acquire(s, "w1", member=s)
        assert isinstance(acquired, Acquired)
        await redis.config_set("maxmemory", 1)
        spec = CommitSpec(member=s, entry_ids=[entry], reply='{"content":"answer"}', transient=True)
        version, _, step = await bus.commit(s, acquired.token, "w1", spec, select=[s])
        await redis.config_set("maxmemory", 0)
        events = [f["payload"] for _, f in await redis.xrange(bus.keys.out(s))]
        assert events == ["earlier, not yet read", '{"content":"answer"}']
        assert version >= 0
        assert isinstance(step, Released)
        assert await redis.exists(bus.keys.inbound(s)) == 0
    finally:
        await bus.aclose()
        await redis.aclose()
        server.cleanup()
