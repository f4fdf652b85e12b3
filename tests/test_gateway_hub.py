"""EventHub (one blocking read for every open event stream of a gateway process), on
fakeredis and on a real redis-server: the resume rule (nothing lost or doubled however
subscriptions, catch-up reads and the shared read interleave), gaps, slow subscribers."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

from bus_redis import OutboundMessage
from bus_redis.keys import Keys
from gateway.hub import CATCH_UP_COUNT, EventHub
from gateway.subscription import BUFFER_BYTES, BUFFER_MAX, HubEvent, Subscription

pytestmark = pytest.mark.frontend
K = Keys()


def _event(session: str, n: int) -> dict[str, str]:
    doc = OutboundMessage(
        type="delta",
        channel="web",
        chat_id=session.partition(":")[2],
        session_key=session,
        reply_to="m",
        content=str(n),
    )
    return {"payload": doc.model_dump_json()}


async def _add(r: aioredis.Redis, session: str, n: int) -> str:
    """An event as a worker adds it: to the session's stream, and its name to the pulse."""
    async with r.pipeline(transaction=True) as pipe:
        pipe.xadd(K.out(session), _event(session, n))
        pipe.xadd(K.pulse("web"), {"o": K.out(session)})
        eid, _ = await pipe.execute()
    return str(eid)


@contextlib.asynccontextmanager
async def _hub(make: Callable[[], aioredis.Redis]) -> AsyncIterator[EventHub]:
    hub = EventHub(
        [make(), make(), make()],
        make(),
        K,
        channel="web",
        wake_key=K.gw_wake("web", "test"),
        max_streams=1000,
        block_ms=200,
    )
    hub.start()
    try:
        yield hub
    finally:
        await hub.stop()


async def _take(sub: Subscription, n: int, timeout_s: float = 10) -> list[HubEvent]:
    out: list[HubEvent] = []

    async def collect() -> None:
        async for ev in sub.events(0.05):
            if ev is not None:
                out.append(ev)
                if len(out) == n:
                    return

    await asyncio.wait_for(collect(), timeout_s)
    return out


async def test_kept_events_after_the_cursor_then_live_ones(redis_factory) -> None:  # type: ignore[no-untyped-def]
    r = redis_factory()
    ids = [await _add(r, "web:a", n) for n in range(3)]
    async with _hub(redis_factory) as hub, hub.subscribe("web:a", ids[0]) as sub:
        first = await _take(sub, 2)
        assert [e.entry_id for e in first] == ids[1:]
        live = await _add(r, "web:a", 3)
        nxt = await _take(sub, 1)
        assert [e.entry_id for e in nxt] == [live]
        assert nxt[0].event is not None
        assert nxt[0].event.content == "3"


async def test_a_resume_holds_a_few_events_at_a_time_not_the_whole_backlog(redis_factory) -> None:  # type: ignore[no-untyped-def]
    """A client resuming far behind takes its first event: the gateway holds the few
    events of one catch-up read for it, not hundreds (a review found 200 answers of any
    size, ~20 MB for 100 KB answers, held per resuming client); all of them come, in
    order."""
    r = redis_factory()
    ids = [await _add(r, "web:a", n) for n in range(100)]
    async with _hub(redis_factory) as hub:
        read: list[int] = []
        read_after = hub.read_after

        async def counted(stream: str, cursor: str, *a: Any) -> tuple[list[HubEvent], str]:
            events, last = await read_after(stream, cursor, *a)
            read.append(len(events))
            return events, last

        hub.read_after = counted  # type: ignore[method-assign]
        got: list[str] = []
        async with hub.subscribe("web:a", "0") as sub:
            events = sub.events(0.05)
            while len(got) < 100:
                ev = await asyncio.wait_for(anext(events), 10)
                if ev is not None:
                    got.append(ev.entry_id)
                if len(got) == 1:  # its client took the first one
                    assert sum(read) <= CATCH_UP_COUNT < 100
            await events.aclose()
    assert got == ids


async def test_a_resume_behind_long_answers_holds_about_a_quarter_mib(redis_factory) -> None:  # type: ignore[no-untyped-def]
    """A catch-up read took 16 events whatever their size and held them while its client
    took the first: answers that copy a message's metadata are up to a payload each, and a
    user's 64 stalled streams held 250 MiB for 5 MB written (a helper's attack, stop 52).
    Now a read holds ``CATCH_UP_BYTES`` beyond its first event, however the events are
    ordered (a short one first, as if the stream's events were short); all of them still
    come, in order."""
    from gateway.subscription import CATCH_UP_BYTES, event_size

    r = redis_factory()
    ids = [await _add(r, "web:big", 0)]  # a short one first
    for n in range(1, 40):
        doc = OutboundMessage(type="message", channel="web", chat_id="big", session_key="web:big",
                              reply_to=f"m{n}", content="y" * 100_000)  # fmt: skip
        ids.append(str(await r.xadd(K.out("web:big"), {"payload": doc.model_dump_json()})))
    async with _hub(redis_factory) as hub:
        held: list[int] = []
        read_after = hub.read_after

        async def measured(stream: str, cursor: str, *a: Any) -> tuple[list[HubEvent], str]:
            events, last = await read_after(stream, cursor, *a)
            held.append(sum(event_size(ev) for ev in events))
            return events, last

        hub.read_after = measured  # type: ignore[method-assign]
        got: list[str] = []
        async with hub.subscribe("web:big", "0") as sub:
            events = sub.events(0.05)
            while len(got) < len(ids):
                ev = await asyncio.wait_for(anext(events), 10)
                if ev is not None:
                    got.append(ev.entry_id)
            await events.aclose()
    assert got == ids
    assert max(held) <= CATCH_UP_BYTES + 100_000, f"a catch-up read held {max(held)} bytes"


async def test_a_resume_reads_on_past_entries_that_are_no_event(redis_factory) -> None:  # type: ignore[no-untyped-def]
    """A catch-up read whose entries are none of them an event (junk a frontend of the
    channel wrote into the stream, more than one read's ``CATCH_UP_COUNT``) returned
    nothing, and the subscriber took that for "caught up": its cursor stayed behind the
    junk, and the events after it never came. Now it reads on past them."""
    r = redis_factory()
    first = await _add(r, "web:j", 0)
    for _ in range(CATCH_UP_COUNT * 2):
        await r.xadd(K.out("web:j"), {"payload": "not an event"})
    after = [await _add(r, "web:j", n) for n in (1, 2)]
    async with _hub(redis_factory) as hub, hub.subscribe("web:j", "0") as sub:
        got = await _take(sub, 3)
        assert [e.entry_id for e in got] == [first, *after]


async def test_a_cursor_older_than_what_is_kept_yields_a_gap_first(redis_factory) -> None:  # type: ignore[no-untyped-def]
    r = redis_factory()
    ids = [await _add(r, "web:g", n) for n in range(5)]
    await r.xtrim(K.out("web:g"), maxlen=2, approximate=False)
    async with _hub(redis_factory) as hub:
        async with hub.subscribe("web:g", ids[0]) as sub:
            got = await _take(sub, 3)
            assert got[0].kind == "gap"
            assert [e.entry_id for e in got[1:]] == ids[3:]
        async with hub.subscribe("web:g", ids[3]) as sub:  # a cursor still kept: no gap
            got = await _take(sub, 1, timeout_s=10)
            assert [(e.kind, e.entry_id) for e in got] == [("event", ids[4])]


async def test_a_subscriber_that_falls_behind_reads_the_rest_from_redis(redis_factory) -> None:  # type: ignore[no-untyped-def]
    r = redis_factory()
    async with _hub(redis_factory) as hub, hub.subscribe("web:slow", "$") as sub:
        ids = [await _add(r, "web:slow", n) for n in range(BUFFER_MAX + 50)]
        got = await _take(sub, len(ids), timeout_s=30)  # nothing read until all were added
        assert [e.entry_id for e in got] == ids


def test_a_subscriber_buffers_at_most_its_bytes_then_reads_from_redis() -> None:
    """Long answers to a reader that stalls: the buffer holds at most ``BUFFER_BYTES`` of
    text, however few the events; past that it is dropped and read again from Redis."""
    sub = Subscription(hub=None, stream="s", cursor="0-0")  # type: ignore[arg-type]
    sub.catch_up = False
    big = "x" * (BUFFER_BYTES // 4)
    for n in range(1, 10):
        event = OutboundMessage(
            type="message", channel="web", chat_id="c", session_key="web:c", content=big
        )
        sub.push(HubEvent("event", f"{n}-0", event))
        assert sub.buffered_bytes <= BUFFER_BYTES
        assert len(sub.buffer) <= 4
    assert sub.catch_up  # it overflowed: the rest comes from Redis
    assert sub.missed_from == "1-0"


async def test_any_interleaving_of_subscribing_and_adding_loses_and_doubles_nothing(
    redis_factory,
) -> None:  # type: ignore[no-untyped-def]
    """Random rounds: events are added while subscribers join at random cursors (kept ids,
    0 or $) and read at random paces; each gets exactly the ids after its cursor, in order."""
    r = redis_factory()
    rng = random.Random(7)
    async with _hub(redis_factory) as hub:
        for rnd in range(4):
            key = f"web:mix{rnd}"
            ids: list[str] = []
            subs: list[tuple[int, list[str], asyncio.Event, asyncio.Task[None]]] = []
            for step in range(60):
                if rng.random() < 0.7:
                    ids.append(await _add(r, key, step))
                if rng.random() < 0.15:
                    choice = rng.choice(["0", "$", *ids[-5:]])
                    start = (
                        0 if choice == "0" else len(ids) if choice == "$" else ids.index(choice) + 1
                    )
                    got: list[str] = []
                    ready = asyncio.Event()
                    grew = asyncio.Event()
                    task = asyncio.create_task(_follow(hub, key, choice, got, ready, grew))
                    await ready.wait()
                    subs.append((start, got, grew, task))
                if rng.random() < 0.3:
                    await asyncio.sleep(0.005 * rng.random())  # the readers run meanwhile
            for start, got, grew, task in subs:
                want = ids[start:]
                with contextlib.suppress(TimeoutError):  # then compared: short is a failure
                    await asyncio.wait_for(_reached(got, grew, len(want)), 10)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                assert got == want
        assert hub.open_streams == 0


async def _reached(got: list[str], grew: asyncio.Event, n: int) -> None:
    while True:
        grew.clear()
        if len(got) >= n:
            return
        await grew.wait()


async def _follow(
    hub: EventHub, key: str, after: str, got: list[str], ready: asyncio.Event, grew: asyncio.Event
) -> None:
    async with hub.subscribe(key, after) as sub:
        ready.set()
        async for ev in sub.events(0.05):
            if ev is not None:
                got.append(ev.entry_id)
                grew.set()


async def test_subscriptions_of_many_sessions_share_a_few_blocking_reads(redis_factory) -> None:  # type: ignore[no-untyped-def]
    r = redis_factory()
    async with _hub(redis_factory) as hub, contextlib.AsyncExitStack() as stack:
        subs = [await stack.enter_async_context(hub.subscribe(f"web:s{i}", "$")) for i in range(50)]
        reads_before = hub.reads
        async with r.pipeline(transaction=True) as pipe:  # 50 sessions' events at once
            for i in range(50):
                pipe.xadd(K.out(f"web:s{i}"), _event(f"web:s{i}", i))
                pipe.xadd(K.pulse("web"), {"o": K.out(f"web:s{i}")})
            await pipe.execute()
        for i, sub in enumerate(subs):
            got = await _take(sub, 1)
            assert got[0].event is not None
            assert got[0].event.content == str(i)
        assert hub.open_streams == 50
        assert hub.reads - reads_before <= 6  # each of the 3 readers: one or two reads for all


async def test_a_subscriber_behind_what_redis_keeps_is_told_of_the_gap(redis_factory) -> None:  # type: ignore[no-untyped-def]
    """It fell behind its buffer and Redis trimmed what it had not read: a gap, then the
    events still kept, in order."""
    r = redis_factory()
    async with _hub(redis_factory) as hub, hub.subscribe("web:far", "$") as sub:
        ids = [await _add(r, "web:far", n) for n in range(BUFFER_MAX + 10)]
        await r.xtrim(K.out("web:far"), maxlen=5, approximate=False)
        got = await _take(sub, 6, timeout_s=30)
        assert got[0].kind == "gap"
        assert [e.entry_id for e in got[1:]] == ids[-5:]


async def test_a_subscriber_that_leaves_at_any_point_leaves_nothing_behind(redis_factory) -> None:  # type: ignore[no-untyped-def]
    """Clients that go away while their subscription is being set up (its Redis reads,
    the wake-up of a reader) leave no followed stream behind to fill ``max_streams``."""

    async def follow(key: str) -> None:
        async with hub.subscribe(key, "$") as sub:
            async for _ev in sub.events(5):
                pass

    async with _hub(redis_factory) as hub:
        for round_ in range(3):
            for i in range(10):
                key = f"web:gone{round_}-{i}"
                task = asyncio.create_task(follow(key))
                followed = hub._reader(K.out(key)).streams
                while K.out(key) not in followed and not task.done():
                    await asyncio.sleep(0)
                for _ in range(i % 3):  # cancelled while the reader is being woken, or later
                    await asyncio.sleep(0)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            assert hub.open_streams == 0, round_
            assert hub.subscribers == 0


@pytest.mark.real_redis
async def test_a_junk_stream_named_with_others_costs_them_nothing_and_is_read_again(
    real_redis, redis_server
) -> None:  # type: ignore[no-untyped-def]
    """(A real server only: fakeredis answers XREAD of a key of another type with a
    Python error, not WRONGTYPE.) One pulse batch names a followed stream and a followed key that is junk (another
    type, which its session's next commit replaces): the stream's event is delivered at
    once; the junk key, replaced within its second, is read again then (its pulse was
    already used up)."""
    r = real_redis

    def redis_factory() -> aioredis.Redis:
        return aioredis.from_url(redis_server.url, decode_responses=True)

    await r.set(K.out("web:junk"), "not a stream")
    async with (
        _hub(redis_factory) as hub,
        hub.subscribe("web:fine", "$") as fine,
        hub.subscribe("web:junk", "$") as junk,
    ):
        reader = hub._reader(K.out("web:junk"))
        while reader.fresh or hub._reader(K.out("web:fine")).fresh:
            await asyncio.sleep(0.01)  # both read once from their cursors
        async with r.pipeline(transaction=True) as pipe:
            pipe.xadd(K.pulse("web"), {"o": K.out("web:junk")})
            pipe.xadd(K.out("web:fine"), _event("web:fine", 1))
            pipe.xadd(K.pulse("web"), {"o": K.out("web:fine")})
            await pipe.execute()
        [got] = await _take(fine, 1)
        assert got.event is not None
        assert got.event.content == "1"
        await r.delete(K.out("web:junk"))  # its session's commit replaces the junk
        replaced = await _add(r, "web:junk", 2)
        [late] = await _take(junk, 1, timeout_s=10)
        assert late.entry_id == replaced


async def test_a_reader_survives_a_redis_error_before_its_first_read(redis_factory) -> None:  # type: ignore[no-untyped-def]
    """The pulse position is taken inside the reader's retry loop: a failed first read
    is retried, not the end of the reader (every stream it serves would go silent)."""
    r = redis_factory()
    async with _hub(redis_factory) as hub:
        broken = hub._readers[0].pulses
        real = broken.add_channels
        calls = 0

        async def flaky(channels: object) -> None:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise ConnectionError("blip")
            await real(channels)  # type: ignore[arg-type]

        for reader in hub._readers:
            reader.pulses.add_channels = flaky  # type: ignore[method-assign]
            reader.pulses.cursors.clear()
        key = next(
            f"web:e{i}" for i in range(100) if hub._reader(K.out(f"web:e{i}")) is hub._readers[0]
        )
        async with hub.subscribe(key, "$") as sub:
            eid = await _add(r, key, 1)
            [got] = await _take(sub, 1, timeout_s=10)
            assert got.entry_id == eid
        assert all(not rd.task.done() for rd in hub._readers if rd.task is not None)
