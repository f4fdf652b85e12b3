"""Races found in review (each reproduced first, then fixed): a control between select and
begin, a late confirmation, a discarded private session in unified mode, a private
stream left in a unified holder's set, client retries of scripts whose reply was lost,
a re-notified private session, the unified queue's unacknowledged entries."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import redis.asyncio as aioredis
from helpers import ScriptedProvider
from replies import collect, until

from bus_redis import FrontendClient, InboundMessage, RedisBus
from bus_redis.results import Acquired, Forward
from worker.agent.providers import LLMResponse


def _m(chat: str, text: str, **kw: Any) -> InboundMessage:
    return InboundMessage(channel="web", sender_id="u", chat_id=chat, content=text, **kw)


async def _stop_between_select_and_begin(
    redis_factory: Any, make_loop: Any, prepare: Any = None
) -> dict[str, list[Any]]:
    """A held turn of ``web:s`` whose stop is published after its entry was selected and
    heard before its turn began (nothing ran: noted for it); ``prepare(loop)`` (optional)
    returns a callback run at that moment. The events of its message, ``m1``."""

    async def handler(**_kw: Any) -> LLMResponse:
        await asyncio.Event().wait()  # held until cancelled
        raise AssertionError("unreachable")

    loop = make_loop(ScriptedProvider(handler=handler))
    at_begin = prepare(loop) if prepare is not None else (lambda: None)
    client = FrontendClient(redis_factory())
    delivered = asyncio.Event()
    on_control = loop.on_control

    def spy(control: Any) -> None:
        on_control(control)
        delivered.set()

    loop.on_control = spy  # type: ignore[method-assign]
    await until(lambda: loop._streams != [])
    real_acquire = loop.bus.acquire

    async def acquire(*a: Any, **kw: Any) -> Any:
        res = await real_acquire(*a, **kw)
        if isinstance(res, Acquired) and res.step is not None and kw.get("member") == "web:s":
            await client.stop("web:s")  # queued after the selection ...
            await asyncio.wait_for(delivered.wait(), 5)  # ... handled before begin()
            at_begin()
        return res

    loop.bus.acquire = acquire  # type: ignore[method-assign]
    mid = await client.send(_m("s", "hello", id="m1"))
    return await collect(client, "web", {mid}, timeout_s=10)


async def test_a_stop_between_select_and_begin_cancels_the_turn(redis_factory, make_loop) -> None:  # type: ignore[no-untyped-def]
    got = await _stop_between_select_and_begin(redis_factory, make_loop)
    assert got["m1"][-1].code == "cancelled"


async def test_a_stop_between_select_and_begin_survives_a_failed_confirmation(  # type: ignore[no-untyped-def]
    redis_factory, make_loop
) -> None:
    """As above, and the confirmation's read fails once (a Redis blip). The look was a task
    of its own that nothing awaited: its error was "never retrieved" and the stop was lost,
    the turn ran on. It is now looked at again, as any control's confirmation is."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    armed, failures = asyncio.Event(), []

    def prepare(loop: Any) -> Any:
        registry = loop.rt.registry
        real_step = registry.markers_step

        async def markers_step(*a: Any, **kw: Any) -> Any:
            if armed.is_set() and not failures:
                failures.append(1)
                raise RedisConnectionError("Connection reset by peer")
            return await real_step(*a, **kw)

        registry.markers_step = markers_step
        return armed.set  # the look begin() starts fails once

    got = await _stop_between_select_and_begin(redis_factory, make_loop, prepare)
    assert failures, "the confirmation was never tried"
    assert got.get("m1"), "the stop was lost with the failed confirmation: the turn runs on"
    assert got["m1"][-1].code == "cancelled"


async def test_a_late_confirmation_never_cancels_the_next_turn(redis_factory, make_loop) -> None:  # type: ignore[no-untyped-def]
    release = asyncio.Event()

    async def handler(**kw: Any) -> LLMResponse:
        if kw["messages"][-1]["content"] == "first":
            await release.wait()
            return LLMResponse(content="answer 1")
        await asyncio.sleep(0.2)  # the second turn is running when the late reply lands
        return LLMResponse(content="answer 2")

    provider = ScriptedProvider(handler=handler)
    loop = make_loop(provider)
    client = FrontendClient(redis_factory())
    real = loop.rt.registry.markers_after

    async def late(running: dict[str, tuple[str, str]]) -> dict[str, str]:
        found = await real(running)  # sees the marker after E1 ...
        if "web:t" not in running:  # (the check after subscribing, before any turn)
            return found
        release.set()  # ... E1 finishes and E2 (published after the stop) begins
        await until(
            lambda: loop.turns.running().get("web:t", ("", ""))[1] not in ("", running["web:t"][1])
        )
        return found

    loop.rt.registry.markers_after = late  # type: ignore[method-assign]
    e1 = await client.send(_m("t", "first", id="e1"))
    await asyncio.wait_for(provider.started.wait(), 5)
    await client.stop("web:t")
    e2 = await client.send(_m("t", "second", id="e2"))
    got = await collect(client, "web", {e1, e2})
    assert got[e2][-1].content == "answer 2"


async def test_a_discarded_private_session_is_never_under_two_leases(
    redis_factory, make_loop
) -> None:  # type: ignore[no-untyped-def]
    calls: Counter[str] = Counter()
    started = asyncio.Event()

    async def handler(**kw: Any) -> LLMResponse:
        text = kw["messages"][-1]["content"]
        calls[text] += 1
        if text == "e1":
            started.set()
            await asyncio.Event().wait()
        await asyncio.sleep(0.05)
        return LLMResponse(content=f"re {text}")

    loop = make_loop(ScriptedProvider(handler=handler), unified_session=True)
    client = FrontendClient(redis_factory())
    _, opened = await client.open_transient("web", "p", session_key="web:p")
    await collect(client, "web", {opened})
    private = {"session_key_override": "web:p", "require_existing_session": True}
    e1 = await client.send(_m("p", "e1", id="e1", **private))
    await asyncio.wait_for(started.wait(), 5)
    await client.discard("web:p")
    e3 = await client.send(_m("p", "e3", id="e3"))  # a durable message for the same key
    got = await collect(client, "web", {e1, e3})
    await until(lambda: not loop.turns.running() and not loop.holders)
    assert got[e1][-1].code == "cancelled"
    assert calls == Counter({"e1": 1, "e3": 1})


async def test_a_private_stream_leaves_the_unified_holder_once(redis_factory, make_loop) -> None:  # type: ignore[no-untyped-def]
    async def handler(**_kw: Any) -> LLMResponse:
        await asyncio.sleep(0.02)
        return LLMResponse(content="ok")

    loop = make_loop(ScriptedProvider(handler=handler), unified_session=True)
    acquires: Counter[str] = Counter()
    real = loop.bus.acquire

    async def count(key: str, worker: str, **kw: Any) -> Any:
        acquires[f"{key}<-{kw.get('member')}"] += 1
        return await real(key, worker, **kw)

    loop.bus.acquire = count  # type: ignore[method-assign]
    client = FrontendClient(redis_factory())
    _, opened = await client.open_transient("web", "p")
    ids = [await client.send(_m("a", f"m{i}", id=f"a{i}")) for i in range(20)]
    await collect(client, "web", {opened, *ids})
    assert acquires["unified:default<-web:p"] <= 2


async def test_a_retried_acquire_finds_its_own_lease(redis: aioredis.Redis) -> None:
    """A client retry of a call that did run (its reply lost) must not orphan the lease."""
    bus = RedisBus(redis)
    await FrontendClient(redis).send(_m("r", "hi"))
    sent: list[tuple[str, list[str], list[Any]]] = []
    call = bus.scripts.call

    async def first_reply_lost(name: str, keys: list[str], args: list[Any]) -> Any:
        reply = await call(name, keys, args)
        if not sent:
            sent.append((name, keys, args))
            return await call(name, keys, args)  # the retry: same command, same nonce
        return reply

    bus.scripts.call = first_reply_lost  # type: ignore[method-assign]
    got = await bus.acquire("web:r", "w1", member="web:r")
    assert isinstance(got, Acquired)
    assert got.token.endswith("|w1")
    assert await redis.get(bus.keys.lease("web:r")) == got.token


async def test_a_retried_emit_adds_its_event_once(redis: aioredis.Redis) -> None:
    bus = RedisBus(redis)
    got = await bus.acquire("web:e", "w1", select=False)
    assert isinstance(got, Acquired)
    payload = '{"v":2,"type":"delta","metadata":{"seq":1}}'
    for _ in range(2):  # the second is a client retry
        assert await bus.emit("web:e", got.token, "web:e", payload, transient=False)
    assert await redis.xlen(bus.keys.out("web:e")) == 1


async def test_a_renotified_private_session_is_forwarded_to_its_owner(
    redis: aioredis.Redis,
) -> None:
    """The lease sweep re-notifies K itself (no stream member): the owner check applies."""
    bus = RedisBus(redis)
    await redis.hset(bus.keys.owner("web:q"), "worker", "w2")
    assert await bus.acquire("web:q", "w1") == Forward("w2")
    assert not await redis.exists(bus.keys.lease("web:q"))


async def test_a_stale_renotification_never_drains_a_folded_stream_under_its_own_lease(
    redis: aioredis.Redis,
) -> None:
    """Unified mode: a re-notification of S as its own key (a takeover or a lease sweep
    of S's lease, when S was a private session) is served after S was folded under the
    unified key, whose holder runs S's entry: it is served as a plain notification of S,
    answered busy by the unified lease, and the entry is not selected a second time
    under a lease of S's own."""
    from bus_redis.results import Entry, Notification
    from worker import AgentLoop, LoopConfig

    s = "web:s"
    await FrontendClient(redis).send(
        InboundMessage(channel="web", sender_id="u", chat_id="s", content="hi")
    )
    bus = RedisBus(redis)
    held = await bus.acquire("unified:default", "w1", member=s)  # S folded, its entry running
    assert isinstance(held, Acquired)
    assert isinstance(held.step, Entry)
    other = RedisBus(redis)
    loop = AgentLoop(other, ScriptedProvider(["x"]), config=LoopConfig(unified_session=True))
    try:
        await loop._serve_note(Notification(bus.keys.ready("web"), "", s, effective=True))
    finally:
        await other.aclose()
        await bus.aclose()
    assert not await redis.exists(bus.keys.lease(s))
    assert await redis.xlen(bus.keys.inbound(s)) == 1  # still the unified holder's to commit
    assert await redis.xlen(bus.keys.out(s)) == 0


async def test_a_stream_with_a_holder_of_its_own_is_busy_not_retried_as_its_own_key(
    redis: aioredis.Redis,
) -> None:
    """Unified mode: S (not private) is held under its own lease (an admin's hold). Its
    notification is answered busy at once, not retried as K = S: released in between,
    S could be folded under the unified key by another worker and its entry selected
    twice. The holder's release re-notifies S, and the unified key then takes it."""
    from bus_redis.results import Busy, Entry, Notification
    from worker import AgentLoop, LoopConfig

    s = "web:s"
    await FrontendClient(redis).send(
        InboundMessage(channel="web", sender_id="u", chat_id="s", content="hi")
    )
    bus = RedisBus(redis)
    own = await bus.acquire(s, "admin", select=False)
    assert isinstance(own, Acquired)
    other = RedisBus(redis)
    loop = AgentLoop(other, ScriptedProvider(["x"]), config=LoopConfig(unified_session=True))
    real, seen, folded = other.acquire, [], []

    async def acquire(key: str, *args: Any, **kw: Any) -> Any:
        got = await real(key, *args, **kw)
        seen.append((key, got))
        if len(seen) == 1:  # between this answer and what the worker does next: the hold
            assert await bus.release(s, own.token)  # ends, another worker folds S
            folded.append(await bus.acquire("unified:default", "w3", member=s))
        return got

    other.acquire = acquire  # type: ignore[method-assign]
    try:
        await loop._serve_note(Notification(bus.keys.ready("web"), "", s))
    finally:
        await other.aclose()
        await bus.aclose()
    assert [(key, type(got)) for key, got in seen] == [("unified:default", Busy)]
    assert isinstance(folded[0], Acquired)
    assert isinstance(folded[0].step, Entry)  # the entry, selected once: under the unified key


async def test_a_private_retry_never_takes_a_stream_folded_meanwhile(
    redis: aioredis.Redis,
) -> None:
    """Unified mode: the notification of S is answered 'private' (S is w1's private
    session). Before the worker retries with K = S, the private session ends (a discard
    drops the owner record) and another worker folds S under the unified key and selects
    its entry. The retry is answered 'fold' (S is no private session any more), and the
    acquire of the unified key then busy: never the same entry under S's own lease too."""
    from bus_redis.results import Busy, Entry, Fold, Notification, Private
    from worker import AgentLoop, LoopConfig

    s = "web:s"
    await FrontendClient(redis).send(
        InboundMessage(channel="web", sender_id="u", chat_id="s", content="hi")
    )
    bus = RedisBus(redis)
    await redis.hset(bus.keys.owner(s), "worker", "w1")
    other = RedisBus(redis)
    loop = AgentLoop(other, ScriptedProvider(["x"]), config=LoopConfig(unified_session=True))
    real, seen, folded = other.acquire, [], []

    async def acquire(key: str, *args: Any, **kw: Any) -> Any:
        got = await real(key, *args, **kw)
        seen.append((key, got))
        if len(seen) == 1:  # between this answer and the retry: the private session ends,
            await redis.delete(bus.keys.owner(s))  # another worker folds S
            folded.append(await bus.acquire("unified:default", "w3", member=s))
        return got

    other.acquire = acquire  # type: ignore[method-assign]
    try:
        await loop._serve_note(Notification(bus.keys.ready("web"), "", s))
    finally:
        await other.aclose()
        await bus.aclose()
    u = "unified:default"
    assert [(key, type(got)) for key, got in seen] == [(u, Private), (s, Fold), (u, Busy)]
    assert isinstance(folded[0], Acquired)
    assert isinstance(folded[0].step, Entry)  # selected once: under the unified key
    assert not await redis.exists(bus.keys.lease(s))


async def test_a_private_retry_when_the_unified_key_is_free_runs_under_it(
    redis: aioredis.Redis,
) -> None:
    """Unified mode: the notification of S is answered 'private'; before the retry with
    K = S the private session ends, and the unified key is free. The retry is answered
    'fold' and the turn runs under the unified key: its history is the unified session's,
    never a durable session stored under S (nor S's own lease taken)."""
    from bus_redis.results import Fold, Notification, Private
    from worker import AgentLoop, LoopConfig

    s, u = "web:s", "unified:default"
    await FrontendClient(redis).send(
        InboundMessage(channel="web", sender_id="u", chat_id="s", content="hi")
    )
    bus = RedisBus(redis)
    await redis.hset(bus.keys.owner(s), "worker", "w1")
    loop = AgentLoop(bus, ScriptedProvider(["x"]), config=LoopConfig(unified_session=True))
    real, seen = bus.acquire, []

    async def acquire(key: str, *args: Any, **kw: Any) -> Any:
        got = await real(key, *args, **kw)
        seen.append((key, got))
        if len(seen) == 1:  # between this answer and the retry: the private session ends
            await redis.delete(bus.keys.owner(s))
        return got

    bus.acquire = acquire  # type: ignore[method-assign]
    try:
        await loop._serve_note(Notification(bus.keys.ready("web"), "", s))
    finally:
        await bus.aclose()
    assert [(key, type(got)) for key, got in seen] == [(u, Private), (s, Fold), (u, Acquired)]
    assert not await redis.exists(bus.keys.session(s), bus.keys.lease(s))
    assert '"hi"' in str(await redis.hvals(bus.keys.session(u)))
    assert await redis.xlen(bus.keys.inbound(s)) == 0


async def test_after_a_private_session_ends_its_next_message_joins_the_unified_session(
    redis_factory, make_loop
) -> None:  # type: ignore[no-untyped-def]
    """Unified mode: a private session's stream is served under its own lease; a discard
    ends the session, and a message sent after it without the override's requirement is
    durable: it is answered in the unified session (stored there, never under the
    stream's own key), the stream's holder having handed it over."""
    from bus_redis import Keys

    loop = make_loop(ScriptedProvider(["opened?", "durable answer"]), unified_session=True)
    client = FrontendClient(redis_factory())
    keys, s = Keys(), "web:p"
    _, opened = await client.open_transient("web", "p", session_key=s)
    await collect(client, "web", {opened})
    private = {"session_key_override": s, "require_existing_session": True}
    first = await client.send(_m("p", "a private message", id="e1", **private))
    await collect(client, "web", {first})
    await client.discard(s)
    later = await client.send(_m("p", "a durable message", id="e2", session_key_override=s))
    got = await collect(client, "web", {later})
    assert got[later][-1].content == "durable answer"
    await until(lambda: not loop.holders)
    stored = str(await redis_factory().hvals(keys.session("unified:default")))
    assert "a durable message" in stored
    assert "durable answer" in stored
    assert "a private message" not in stored
    assert not await redis_factory().exists(keys.session(s))


async def test_an_owner_whose_record_ran_out_never_takes_a_stream_folded_meanwhile(
    redis: aioredis.Redis,
) -> None:
    """Unified mode: w1 holds S's private session in memory, but its owner record ran out
    (a stall): another worker folded S under the unified key and runs its entry. w1's
    acquire of S as its own key is answered busy, not a second selection of the entry."""
    from bus_redis.results import Busy, Entry

    s, u = "web:s", "unified:default"
    await FrontendClient(redis).send(
        InboundMessage(channel="web", sender_id="u", chat_id="s", content="hi")
    )
    w1, w3 = RedisBus(redis), RedisBus(redis)
    folded = await w3.acquire(u, "w3", member=s)
    assert isinstance(folded, Acquired)
    assert isinstance(folded.step, Entry)
    mine = await w1.acquire(s, "w1", member=s, claim_owner=True, fold=u)
    assert isinstance(mine, Busy)
    assert not await redis.exists(w1.keys.owner(s))  # nothing claimed on a busy answer
    assert await redis.sismember(w1.keys.pending(u), s)  # still the unified holder's
    await w1.aclose()
    await w3.aclose()


async def test_a_stream_the_unified_pending_set_lost_is_renotified_while_the_key_is_held(
    redis: aioredis.Redis,
) -> None:
    """Unified mode: the unified key's release re-notified it, but its pending set ran out
    (2 lease TTLs) before that note was served (every worker down, or busy, that long):
    the note finds nothing, and S's entry has no notification. The stranded-stream sweep
    re-notifies S although the unified key is held again by then; a stream that is in the
    held key's pending set is left to its holder."""
    from bus_redis.registry import Registry
    from bus_redis.results import Entry, Released

    s, t, u = "web:s", "web:t", "unified:default"
    client = FrontendClient(redis)
    bus = RedisBus(redis)
    streams = bus.note_streams("w", ["web", "unified"])
    await bus.ensure_groups(streams)

    async def read() -> list[Any]:
        return await bus.read_notifications("w", streams, count=10, block_ms=10)

    await client.send(_m("s", "waits"))
    [note] = await read()
    held = await bus.acquire(u, "h", member=s, note=note)
    assert isinstance(held, Acquired)
    assert isinstance(held.step, Entry)
    assert await bus.release(u, held.token)  # a shutdown: an effective note of U queued
    await redis.delete(bus.keys.pending(u))  # ... and the pending set ran out meanwhile
    [note] = await read()
    assert note.effective
    done = await bus.acquire(u, "w2", note=note)  # what the worker does with it
    assert isinstance(done, Acquired)
    assert isinstance(done.step, Released)
    await client.send(_m("t", "keeps U busy"))
    [note] = await read()
    busy = await bus.acquire(u, "w3", member=t, note=note)  # U held, T in its pending set
    assert isinstance(busy, Acquired)
    sweeps = Registry(bus).sweeps
    await redis.zadd(bus.keys.queued("web"), {t: 0})
    assert sorted(await sweeps.queued("web", unified=True, in_flight_ms=0)) == [s]
    assert [n.session_key for n in await read()] == [s]
    await bus.aclose()


async def test_a_delete_that_never_takes_effect_is_dropped_after_its_deliveries(
    redis_factory, make_loop
) -> None:  # type: ignore[no-untyped-def]
    """A delete marker stays at the head until its effect is done; one reached more often
    than AGENT_MAX_DELIVERIES (every holder died or failed before deleting) is dropped
    without its effect, as a poison entry is, instead of blocking its chat for good. The
    message after it is answered."""
    r = redis_factory()
    client = FrontendClient(r)
    bus = RedisBus(r)
    s = "web:s"
    await client.delete(s)
    [(marker, _)] = await r.xrange(bus.keys.inbound(s))
    await r.hset(bus.keys.attempts(s), marker, 5)  # five holders died with it
    before = '{"role": "user", "content": "before"}'
    await r.hset(bus.keys.session(s), mapping={"count": 1, "version": 1, "m:0": before})
    mid = await client.send(_m("s", "after it", id="m1"))
    make_loop(ScriptedProvider(["answered"]), max_deliveries=5)
    got = await collect(client, "web", {mid})
    assert [e.content for e in got[mid] if e.content] == ["answered"]
    assert await r.hget(bus.keys.session(s), "m:0") == before  # not deleted
    assert not await r.hexists(bus.keys.attempts(s), marker)


async def test_the_unified_queue_is_reclaimed_from_a_dead_consumer(
    redis_factory, make_loop
) -> None:  # type: ignore[no-untyped-def]
    r = redis_factory()
    ready = "agent:{unified}:ready"
    await r.xgroup_create(ready, "workers", id="0", mkstream=True)
    await r.xadd(ready, {"session": "unified:default", "effective": "1"})
    await r.xreadgroup("workers", "dead-worker", {ready: ">"}, count=1)  # read, then died
    make_loop(ScriptedProvider(["x"]), unified_session=True, lock_ttl_ms=300)
    pending = -1

    async def claimed() -> bool:
        nonlocal pending
        pending = (await r.xpending(ready, "workers"))["pending"]
        return pending == 0

    deadline = asyncio.get_running_loop().time() + 10
    while not await claimed():
        assert asyncio.get_running_loop().time() < deadline, pending
        await asyncio.sleep(0.05)  # poll: the worker's maintenance claims it


async def test_a_control_naming_its_marker_cancels_only_the_entries_before_it() -> None:
    """The pub/sub message names its marker: a turn of an earlier entry of that stream is
    cancelled at once (no stream read); a turn of a later entry (the marker was consumed
    before it was selected: a late message) is left alone; a folded turn of another
    stream is confirmed by reading, as before."""
    from bus_redis import ControlMessage
    from worker.runtime.controls import Controls
    from worker.runtime.inflight import TurnRegistry

    looked: list[dict[str, tuple[str, str]]] = []

    class Rt:  # the slice of Runtime that Controls uses
        def __init__(self) -> None:
            self.turns = TurnRegistry()
            self.sessions = type(
                "S",
                (),
                {
                    "is_transient": staticmethod(lambda k: False),
                    "invalidate": staticmethod(lambda k: None),
                },
            )()
            self.metrics = type(
                "M", (), {"cancel_seconds": type("H", (), {"observe": lambda *a: None})()}
            )()

    rt = Rt()
    controls = Controls(rt)  # type: ignore[arg-type]

    async def confirm(running: dict[str, tuple[str, str]]) -> None:
        looked.append(running)

    controls.confirm_and_cancel = confirm  # type: ignore[method-assign]
    rt.turns.begin("web:a", "web:a", "1700000000000-5")
    rt.turns.begin("web:b", "web:b", "1700000000002-0")
    rt.turns.begin("unified:default", "web:c", "1700000000000-0")

    controls.on_control(ControlMessage(op="stop", session_key="web:a", marker="1700000000000-6"))
    controls.on_control(ControlMessage(op="stop", session_key="web:b", marker="1700000000001-9"))
    controls.on_control(
        ControlMessage(op="stop", session_key="unified:default", marker="1700000000001-0")
    )
    assert rt.turns.reason("web:a") == "stop"  # at once, before any task ran
    assert rt.turns.reason("web:b") is None
    assert rt.turns.reason("unified:default") is None
    assert controls._task is not None
    await controls._task
    assert looked == [{"unified:default": ("web:c", "1700000000000-0")}]
