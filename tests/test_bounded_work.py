"""Bounded work per script call (issue 12): what one frontend queued is consumed or read
in bounded steps across calls, so no call stalls Redis for the other channels, and the
guarantee stays exact (a marker covers exactly the messages before it).

The bounds are asserted on behaviour (what one call consumed or read), never on time.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest
import redis.asyncio as aioredis
from replies import wait_until_async

from bus_redis import FrontendClient, InboundMessage, RedisBus
from bus_redis.registry import Registry
from bus_redis.results import Acquired, Again, ControlReached, Entry
from bus_redis.sweeps import SCAN_COUNT

K = "web:s"
HEAD_BATCH = 64  # bus_redis/lua/_common.lua
MARKER_SCAN = 256


def _msg(text: str) -> InboundMessage:
    return InboundMessage(channel="web", sender_id="u", chat_id="s", content=text)


async def _stops(redis: aioredis.Redis, n: int, op: str = "stop") -> None:
    """``n`` markers as a hostile frontend queues them (what FrontendClient.control does,
    without the pub/sub), in one pipeline."""
    bus = RedisBus(redis)
    async with redis.pipeline(transaction=False) as pipe:
        for _ in range(n):
            pipe.xadd(bus.keys.inbound(K), {"control": op})
            pipe.incr(bus.keys.control_hint(K))
        await pipe.execute()


async def test_markers_at_the_head_are_consumed_a_batch_per_call(redis: aioredis.Redis) -> None:
    client, bus = FrontendClient(redis), RedisBus(redis, lock_ttl_ms=5000)
    n = 3 * HEAD_BATCH + 10
    await _stops(redis, n)
    await client.send(_msg("after the stops"))
    got = await bus.acquire(K, "w1", member=K)
    assert isinstance(got, Acquired)
    steps = [got.step]
    lengths = [await redis.xlen(bus.keys.inbound(K))]
    while isinstance(steps[-1], Again):
        steps.append(await bus.next(K, got.token, [K]))
        lengths.append(await redis.xlen(bus.keys.inbound(K)))
    # every call consumed at most one batch, and the message after them was reached
    assert [type(s) for s in steps] == [Again, Again, Again, Entry]
    assert lengths == [n + 1 - HEAD_BATCH, n + 1 - 2 * HEAD_BATCH, n + 1 - 3 * HEAD_BATCH, 1]
    entry = steps[-1]
    assert isinstance(entry, Entry)
    assert entry.attempts == 1  # the steps before counted no delivery
    assert entry.covered_by == ""  # the stops were all before it
    assert not await redis.exists(bus.keys.control_hint(K))


async def test_a_discard_among_many_markers_is_reported_then_the_rest_consumed(
    redis: aioredis.Redis,
) -> None:
    client, bus = FrontendClient(redis), RedisBus(redis, lock_ttl_ms=5000)
    await _stops(redis, 10)
    await _stops(redis, 1, op="discard")
    await _stops(redis, 2 * HEAD_BATCH)
    await client.send(_msg("x"))
    got = await bus.acquire(K, "w1", member=K)
    assert isinstance(got, Acquired)
    assert got.step == ControlReached(K, "discard")
    steps = []
    step = await bus.next(K, got.token, [K])
    while not isinstance(step, Entry):
        steps.append(step)
        step = await bus.next(K, got.token, [K])
    assert all(isinstance(s, Again) for s in steps)
    assert len(steps) <= 2


async def test_a_long_queue_is_scanned_for_markers_in_steps_and_once(
    redis: aioredis.Redis,
) -> None:
    """A hint set again and again over a long queue without markers: each call reads at
    most MARKER_SCAN entries, and once the end was reached a re-set hint costs nothing."""
    client, bus = FrontendClient(redis), RedisBus(redis, lock_ttl_ms=5000)
    n = 2 * MARKER_SCAN + 5
    for i in range(n):
        await client.send(_msg(f"m{i}"))
    hint = bus.keys.control_hint(K)
    await redis.set(hint, 1_000_000)  # the frontend claims markers are queued
    got = await bus.acquire(K, "w1", member=K)
    assert isinstance(got, Acquired)
    steps = [got.step]
    while isinstance(steps[-1], Again):
        steps.append(await bus.next(K, got.token, [K]))
    assert [type(s) for s in steps] == [Again, Again, Entry]
    assert steps[-1].covered_by == ""
    assert steps[-1].attempts == 1
    assert not await redis.exists(hint)  # no marker queued: the hint is gone

    await redis.set(hint, 5)  # set again: the memo says the queue was read to its end
    await redis.delete(bus.keys.lease(K))
    again = await bus.acquire(K, "w2", member=K)
    assert isinstance(again, Acquired)
    assert isinstance(again.step, Entry)
    await client.stop(K)  # a real marker after all of them
    # the running entry's confirmation finds it in one step (memo: read to the old end)
    found = await Registry(bus).markers_after({K: (K, again.step.entry_id)})
    assert found == {K: "stop"}
    await redis.delete(bus.keys.lease(K))
    third = await bus.acquire(K, "w3", member=K)
    assert isinstance(third, Acquired)
    assert isinstance(third.step, Entry)
    assert third.step.covered_by == "stop"


async def test_a_marker_far_behind_a_running_entry_is_confirmed(redis: aioredis.Redis) -> None:
    client, bus = FrontendClient(redis), RedisBus(redis, lock_ttl_ms=5000)
    for i in range(MARKER_SCAN * 3):
        await client.send(_msg(f"m{i}"))
    got = await bus.acquire(K, "w1", member=K)
    assert isinstance(got, Acquired)
    assert isinstance(got.step, Entry)
    registry = Registry(bus)
    assert await registry.markers_after({K: (K, got.step.entry_id)}) == {}
    await client.stop(K)
    assert await registry.markers_after({K: (K, got.step.entry_id)}) == {K: "stop"}
    # an entry that is not the oldest (the in-process API's marker) is read without memos
    assert await registry.markers_after({K: (K, "1-0")}) == {K: "stop"}


def test_controls_for_sessions_running_nowhere_are_remembered_per_channel_and_bounded() -> None:
    from worker.runtime.inflight import RECENT_PER_CHANNEL, TurnRegistry

    turns = TurnRegistry()
    turns.note_control("telegram:t")
    for i in range(20_000):  # a flood of controls for made-up web sessions
        turns.note_control(f"web:f{i}")
    assert len(turns._recent["web"]) == RECENT_PER_CHANNEL
    assert turns.take_recent("telegram:t")  # another channel's control was not pushed out
    assert turns.take_recent(f"web:f{20_000 - 1}")
    assert not turns.take_recent("web:f0")


async def test_a_control_flood_for_a_running_session_is_one_look() -> None:
    """Any number of controls for a running session while a look is under way cost one
    more look, not one task (or one Redis call) each."""
    from bus_redis import ControlMessage
    from worker.runtime.controls import Controls

    calls: list[dict[str, tuple[str, str]]] = []

    class Rt:  # the slice of Runtime that Controls uses
        def __init__(self) -> None:
            from worker.runtime.inflight import TurnRegistry

            self.turns = TurnRegistry()
            self.turns.begin(K, K, "1-0")
            self.sessions = type(
                "S",
                (),
                {
                    "is_transient": staticmethod(lambda k: False),
                    "invalidate": staticmethod(lambda k: None),
                },
            )()

    rt = Rt()
    controls = Controls(rt)  # type: ignore[arg-type]

    async def confirm(running: dict[str, tuple[str, str]]) -> None:
        calls.append(running)
        await asyncio.sleep(0.01)

    controls.confirm_and_cancel = confirm  # type: ignore[method-assign]
    for _ in range(10_000):
        controls.on_control(ControlMessage(op="stop", session_key=K))
    assert controls._task is not None
    await controls._task
    assert calls == [{K: (K, "1-0")}]
    for _ in range(10_000):
        controls.on_control(ControlMessage(op="stop", session_key="web:elsewhere"))
    assert len(calls) == 1  # not running here: remembered (bounded), nothing confirmed


async def test_ids_beyond_double_precision_are_compared_exactly(redis: aioredis.Redis) -> None:
    """Explicit ids above 2^53 (a frontend may XADD them) neither loop the scan nor hide a
    marker: ids are compared as digit strings."""
    bus = RedisBus(redis, lock_ttl_ms=5000)
    stream, big = bus.keys.inbound(K), 2**53
    first = _msg("first").model_dump_json(exclude_none=True)
    async with redis.pipeline(transaction=False) as pipe:
        pipe.xadd(stream, {"payload": first}, id=f"{big}-0")
        for i in range(MARKER_SCAN + 10):
            pipe.xadd(stream, {"payload": first}, id=f"{big + 1}-{i}")
        pipe.xadd(stream, {"control": "stop"}, id=f"{big + 1}-{MARKER_SCAN + 10}")
        pipe.incr(bus.keys.control_hint(K))
        await pipe.execute()
    got = await bus.acquire(K, "w1", member=K)
    assert isinstance(got, Acquired)
    steps = [got.step]
    while isinstance(steps[-1], Again) and len(steps) < 10:
        steps.append(await bus.next(K, got.token, [K]))
    assert [type(s) for s in steps] == [Again, Entry]
    assert steps[-1].covered_by == "stop"  # type: ignore[union-attr]
    assert steps[-1].entry_id == f"{big}-0"  # type: ignore[union-attr]


async def test_a_marker_scan_reads_a_bounded_number_of_bytes(redis: aioredis.Redis) -> None:
    client, bus = FrontendClient(redis), RedisBus(redis, lock_ttl_ms=5000)
    await client.send(_msg("small"))
    for _ in range(10):
        await client.send(_msg("x" * 300_000))  # 3 MB queued behind it
    await client.stop(K)
    got = await bus.acquire(K, "w1", member=K)
    assert isinstance(got, Acquired)
    steps = [got.step]
    while isinstance(steps[-1], Again):
        steps.append(await bus.next(K, got.token, [K]))
    # each call stops once it has read 1 MiB (4 entries of 300 kB): 4 + 4, then 2 and the stop
    assert [type(s) for s in steps] == [Again, Again, Entry]
    assert steps[-1].covered_by == "stop"  # type: ignore[union-attr]


async def test_one_sessions_long_queue_never_holds_back_anothers_stop(
    redis: aioredis.Redis,
) -> None:
    """One bounded step per session and pass: a session whose look needs many steps (its
    running entry is not the oldest, so no memo helps) gets ``again``; another session's
    marker is found in the same pass."""
    client, bus = FrontendClient(redis), RedisBus(redis, lock_ttl_ms=5000)
    registry = Registry(bus)
    other = "web:other"
    for i in range(3 * MARKER_SCAN):
        await client.send(_msg(f"m{i}"))
    await redis.incr(bus.keys.control_hint(K))
    await client.send(InboundMessage(channel="web", sender_id="u", chat_id="other", content="x"))
    await client.stop(other)
    second = (await redis.xrange(bus.keys.inbound(K), count=2))[1][0]
    running = {K: (K, second), other: (other, "1-0")}
    found, again = await registry.markers_step(running)
    assert found == {other: "stop"}
    assert set(again) == {K}
    steps = 1
    while again:
        found, again = await registry.markers_step({K: running[K]}, again)
        steps += 1
    assert found == {}
    assert steps == 3  # 766 entries after the running one, 256 a step


async def test_compaction_keeps_ids_and_the_id_floor(redis: aioredis.Redis) -> None:
    """The rewrite of a private session's events keeps their ids, and the next event gets
    an id above every id the stream ever had (a reader's position stays valid)."""
    bus = RedisBus(redis, lock_ttl_ms=5000)
    out = bus.keys.out(K)
    await redis.set(bus.keys.lease(K), "n|w")
    ids = [await redis.xadd(out, {"payload": f"e{i}"}) for i in range(5)]
    await redis.pexpire(out, 50_000)
    await redis.xdel(out, ids[0], ids[3], ids[4])  # read and deleted, the newest too
    assert await bus.compact_private(K, "n|w", K) == 2
    assert [e for e, _ in await redis.xrange(out)] == [ids[1], ids[2]]
    assert 0 < await redis.pttl(out) <= 50_000
    new = await redis.xadd(out, {"payload": "next"})
    assert new > ids[4] or len(new) > len(ids[4])
    reply = await redis.xread({out: ids[4]})
    assert [e for e, _ in reply[0][1]] == [new]


async def test_keys_longer_than_the_wire_allows_are_junk(redis: aioredis.Redis) -> None:
    from bus_redis.keys import MAX_SESSION_KEY, in_channel
    from bus_redis.sweeps import Sweeps

    long_key = "web:" + "x" * MAX_SESSION_KEY
    assert not in_channel(long_key, "web")
    bus = RedisBus(redis)
    await redis.zadd(bus.keys.queued("web"), {long_key: 0, "telegram:t": 0})
    assert await Sweeps(bus).queued("web", unified=False) == []
    assert await redis.zcard(bus.keys.queued("web")) == 0


async def test_an_entry_at_the_maximal_id_breaks_no_look(redis: aioredis.Redis) -> None:
    """A frontend may XADD at the maximal id: selection, marker scans and confirmations
    still answer (for every session looked at in the same pass)."""
    client, bus = FrontendClient(redis), RedisBus(redis, lock_ttl_ms=5000)
    stream = bus.keys.inbound(K)
    await client.send(_msg("first"))
    await client.stop(K)
    await redis.xadd(stream, {"control": "stop"}, id="18446744073709551615-18446744073709551615")
    await redis.incr(bus.keys.control_hint(K))
    other = "web:other"
    await client.send(InboundMessage(channel="web", sender_id="u", chat_id="other", content="x"))
    await client.stop(other)
    got = await bus.acquire(K, "w1", member=K)
    assert isinstance(got, Acquired)
    assert isinstance(got.step, Entry)
    assert got.step.covered_by == "stop"
    found = await Registry(bus).markers_after({K: (K, got.step.entry_id), other: (other, "1-0")})
    assert found == {K: "stop", other: "stop"}


async def test_adding_a_channel_drops_no_other_channels_subscription(
    real_redis: aioredis.Redis,
    redis_server,  # type: ignore[no-untyped-def]
) -> None:
    """Channels never move between subscriptions: a control published on one channel while
    another is added (even one that sorts between) is received."""
    from bus_redis import ControlMessage, Keys
    from worker.runtime.subscription import ControlListener

    got: list[str] = []
    looks = 0

    async def on_subscribed() -> None:
        nonlocal looks
        looks += 1

    raw = aioredis.from_url(redis_server.url)
    listener = ControlListener(
        raw, Keys(), lambda c: got.append(c.session_key), on_subscribed, connections=2
    )
    listener.set_channels({"web", "zeta"})
    task = asyncio.create_task(listener.run())
    try:
        await asyncio.wait_for(listener.subscribed.wait(), 10)
        before = [set(s) for s in listener._want]
        body = ControlMessage(op="stop", session_key="web:1").model_dump_json()
        for i in range(200):
            if i == 50:
                listener.set_channels({"web", "zeta", "mid"})
            assert await real_redis.publish(Keys().control("web"), body) == 1
            await asyncio.sleep(0)
        assert await wait_until_async(lambda: _true(len(got) >= 200), timeout_s=10)
        assert got == ["web:1"] * 200
        assert all(b <= a for b, a in zip(before, listener._want, strict=True))  # nothing moved
        await asyncio.wait_for(listener.subscribed.wait(), 10)
        assert looks == 3  # each new channel's confirmed subscription looked for missed markers
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await raw.aclose()


async def _true(value: bool) -> bool:
    return value


async def test_channel_discovery_scans_a_bounded_number_of_keys_per_call(
    redis: aioredis.Redis,
) -> None:
    """Discovery finds a channel nobody registered (its ready queue exists) however large
    the keyspace a flooding channel wrote, in steps: each call issues at most ``steps``
    SCANs of ``SCAN_COUNT`` keys, resumed where the last call stopped, whichever worker
    made it (the cursor is shared: ``P:discovery``)."""
    bus = RedisBus(redis)
    workers = [Registry(bus), Registry(bus)]  # two workers taking turns at sweeping
    async with redis.pipeline(transaction=False) as pipe:
        for i in range(5000):  # what a flood left: keys, not channels
            pipe.set(f"{bus.keys.prefix}:{{flood}}:junk:{i}", "x")
        await pipe.execute()
    await redis.xadd(bus.keys.ready("quiet"), {"session": "quiet:s"})
    calls: list[list[tuple[int, int]]] = []  # per discovery call: (cursor sent, cursor got)
    scan = bus.raw.scan

    async def counted(cursor: int = 0, **kwargs: object) -> object:
        assert kwargs.get("count") == SCAN_COUNT
        reply = await scan(cursor, **kwargs)  # type: ignore[arg-type]
        calls[-1].append((int(cursor), int(reply[0])))
        return reply

    bus.raw.scan = counted  # type: ignore[method-assign]
    found: set[str] = set()
    for i in range(12):  # a full pass: 5,001 keys / 1,000 per step, and some slack
        calls.append([])
        found |= await workers[i % 2].discover_channels(steps=1)
        if calls[-1][-1][1] == 0:  # the pass ended
            break
    assert found == {"quiet"}
    assert all(len(c) == 1 for c in calls)  # one SCAN step per call, never more
    assert calls[0][0][0] == 0
    assert calls[0][0][1] != 0
    for before, after in itertools.pairwise(calls):
        assert after[0][0] == before[-1][1]  # each call goes on where the last stopped
    assert "quiet" in await workers[0].registered_channels()
    kept = await redis.get(bus.keys.discovery)
    await redis.set(bus.keys.discovery, calls[0][0][1])  # mid-pass
    calls.append([])
    assert await workers[0].discover_channels(steps=None) == {"quiet"}  # administration
    assert calls[-1][0][0] == 0
    assert calls[-1][-1][1] == 0
    assert int(await redis.get(bus.keys.discovery)) == calls[0][0][1]  # the pass left alone
    assert kept is not None
    for junk in ("x", "-5", "²", "9" * 40, str(2**64)):  # what an operator's mistake leaves there
        await redis.set(bus.keys.discovery, junk)
        calls.append([])
        await workers[0].discover_channels(steps=1)
        assert calls[-1][0][0] == 0  # starts over


async def test_the_sweep_adds_no_notification_behind_one_that_waits_unread(
    redis: aioredis.Redis,
) -> None:
    """A backlog: notifications wait unread in the ready queue for longer than the sweep's
    in-flight allowance. Re-notifying them would queue duplicates, each costing a worker an
    acquire that finds nothing, where load is already too high: the sweep does not. Once the
    workers have read past a session's entry and nobody holds it, it is stranded and
    re-notified; so is one whose queue holds nothing, and one waiting past BACKLOG_MS."""
    from bus_redis.streams import WORKER_GROUP
    from bus_redis.sweeps import BACKLOG_MS, Sweeps

    bus = RedisBus(redis)
    sweeps = Sweeps(bus)
    k = bus.keys
    seconds, micros = await redis.time()
    now = int(seconds) * 1000 + int(micros) // 1000

    async def publish(channel: str, chat: str, at_ms: int, *, notify: bool = True) -> str:
        session = f"{channel}:{chat}"
        await redis.xadd(k.inbound(session), {"payload": "{}"}, id=f"{at_ms}-0")
        await redis.zadd(k.queued(channel), {session: 0})
        if notify:
            await redis.xadd(k.ready(channel), {"session": session}, id=f"{at_ms}-0")
        return session

    await bus.ensure_groups([k.ready(c) for c in ("web", "tg", "x", "y")])
    b0, b1, _b2 = [await publish("web", f"b{i}", now - 5000 + 1000 * i) for i in range(3)]
    assert await sweeps.queued("web", unified=False, recheck_ms=0) == []  # all waiting
    assert await redis.xlen(k.ready("web")) == 3  # nothing queued twice

    await redis.xreadgroup(WORKER_GROUP, "gone", {k.ready("web"): ">"}, count=2)  # b0, b1
    assert sorted(await sweeps.queued("web", unified=False, recheck_ms=0)) == [b0, b1]
    assert await redis.xlen(k.ready("web")) == 5  # b2 still waits behind its one notification

    old = await publish("tg", "old", now - BACKLOG_MS - 1000)  # unread for too long
    assert await sweeps.queued("tg", unified=False) == [old]
    lost = await publish("x", "lost", now - 5000, notify=False)  # nothing in its queue
    assert await sweeps.queued("x", unified=False) == [lost]
    # what a queue holds may all be read already (a worker's batch, a dead consumer's):
    # then nothing waits unread in it, and a lost notification is found at once
    taken = await publish("y", "taken", now - 5000)
    await redis.xreadgroup(WORKER_GROUP, "busy", {k.ready("y"): ">"}, count=1)
    also_lost = await publish("y", "also-lost", now - 3000, notify=False)
    assert sorted(await sweeps.queued("y", unified=False)) == [also_lost, taken]
    # nothing left queued for a worker of a later test on the shared server
    channels = ("web", "tg", "x", "y")
    await redis.delete(*(k.ready(c) for c in channels), *(k.queued(c) for c in channels))
    await redis.delete(*(k.inbound(s) for s in (b0, b1, _b2, old, lost, taken, also_lost)))


async def test_only_a_ready_queue_that_can_never_take_an_entry_is_re_created(
    redis: aioredis.Redis,
) -> None:
    """A ready queue is deleted and re-created only when XADD can never succeed on it (a
    frontend gave it the maximal id, or made it another type), never because Redis is in
    a state (out of memory, read-only, loading): that would drop every notification in it
    and leave the sessions to the much slower index sweep."""
    from redis.exceptions import OutOfMemoryError, ReadOnlyError, ResponseError

    from bus_redis.queue import unusable_queue
    from bus_redis.sweeps import Sweeps

    bus = RedisBus(redis)
    full, other = bus.keys.ready("web"), bus.keys.ready("telegram")
    kept = bus.keys.ready("slack")
    try:
        await redis.xadd(full, {"session": "web:x"}, id="18446744073709551615-18446744073709551615")
        await redis.set(other, "not a stream")
        refusals = []
        for stream in (full, other):
            with pytest.raises(ResponseError) as refused:  # what the server at hand answers
                await redis.xadd(stream, {"session": "web:y"})
            refusals.append(str(refused.value))
        assert all(unusable_queue(why) for why in refusals), refusals
        for transient in (
            "OOM command not allowed when used memory > 'maxmemory'.",  # as a script reports it
            str(OutOfMemoryError("command not allowed when used memory > 'maxmemory'.")),
            str(ReadOnlyError("You can't write against a read only replica.")),
            "LOADING Redis is loading the dataset in memory",
        ):
            assert not unusable_queue(transient), transient
        await redis.xadd(kept, {"session": "slack:a"})
        sweeps = Sweeps(bus)
        await sweeps.repair_ready(
            "slack", "OOM command not allowed when used memory > 'maxmemory'."
        )
        assert await redis.xlen(kept) == 1  # left as it is
        await sweeps.repair_ready("web", refusals[0])
        assert await redis.xlen(full) == 0  # re-created, empty, with its group
        assert [g["name"] for g in await redis.xinfo_groups(full)] == ["workers"]
        # a key of another type at a queue's name fails every read of the worker (all
        # channels at once): making the groups replaces it
        await bus.ensure_groups([other, kept])
        assert [g["name"] for g in await redis.xinfo_groups(other)] == ["workers"]
        assert await redis.xlen(kept) == 1
    finally:  # no junk for the suite's later workers
        await redis.delete(full, other, kept)
