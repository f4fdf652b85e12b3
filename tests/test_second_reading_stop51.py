"""A hostile second reading of stop 51's code (a helper's attack, stop 52; each failed
before its fix) (interrupts.lua and its memo, owned_by and
end_former_private, the subagent abort task, the control junk log, keep_error_events),
by a helper. On fakeredis and a real redis-server where the ``redis_factory`` fixture
runs them."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from helpers import ScriptedProvider
from replies import collect, wait_until_async
from test_interrupt_scope import Model, _alice_working, _cut, _refused

from bus_redis import ControlMessage, FrontendClient, InboundMessage, RedisBus
from worker import AgentLoop, LoopConfig

ROUTE: dict[str, Any] = {"channel": "web", "chat_id": "a"}


async def _held_publish(redis_factory: Any) -> tuple[FrontendClient, list[tuple[Any, Any]]]:
    """A frontend (another gateway replica) whose PUBLISHes are held back: its MULTI is
    written, its control is not published yet (a slow replica: the PUBLISH is a second
    round trip after the transaction)."""
    slow = FrontendClient(redis_factory())
    held: list[tuple[Any, Any]] = []

    async def hold(channel: Any, data: Any) -> int:
        held.append((channel, data))
        return 0

    slow.redis.publish = hold  # type: ignore[method-assign]
    return slow, held


async def test_the_owners_interrupt_published_after_a_later_foreign_one_is_refused_unread(
    redis_factory,
) -> None:  # type: ignore[no-untyped-def]
    """Two gateway replicas: alice's interrupt transaction is written first (marker Ma,
    her message), bob's second (marker Mb > Ma, his message); bob's PUBLISH reaches the
    worker first (each PUBLISH is its own round trip after its MULTI). Bob's is read and
    refused; the memo then records Mb as "read" for the running entry, and alice's
    control, heard next, names Ma <= Mb: refused unread ("a marker already looked at"),
    though Ma itself was never read (the walk went forward from Mb). ARCHITECTURE/
    SECURITY: the owner's interrupt "is read when it is the latest heard in a pass": it
    is the only one heard in its pass, and her turn is not cut."""
    async with _alice_working(redis_factory) as w:
        loop, client = w.loop, w.client
        slow, held = await _held_publish(redis_factory)
        await slow.send(
            InboundMessage(
                id="a1", content="stop", followup="interrupt", **ROUTE, sender_id="alice"
            )
        )
        assert len(held) == 1  # her transaction is in the stream, her control not yet out
        await client.send(
            InboundMessage(id="b", content="x", followup="interrupt", **ROUTE, sender_id="bob")
        )

        async def bob_refused() -> bool:
            await loop.controls.interrupts.settled()
            return _refused(loop) == 1

        assert await wait_until_async(bob_refused, timeout_s=10)
        await client.redis.publish(*held[0])  # her replica's PUBLISH arrives now

        async def decided() -> bool:
            await loop.controls.interrupts.settled()
            return _refused(loop) > 1 or _cut(loop) > 0

        assert await wait_until_async(decided, timeout_s=10)
        w.model.release.set()
        got = await collect(client, "web", {"w"})
    assert got["w"][-1].code == "cancelled"  # her own interrupt must cut her turn


async def test_a_foreign_interrupt_cuts_an_in_process_turn_once_the_worker_looks_for_missed_controls(
    redis_factory,
) -> None:  # type: ignore[no-untyped-def]
    """``markers.lua``: when the running entry is not in the stream (the in-process API's
    turn runs under an id made of the clock, ``direct.py``), its first branch returns the
    op of the first control marker after it, ``interrupt`` included, and
    ``confirm_and_cancel`` applies it with no scope check (``covering_op`` skips interrupt
    markers; these branches do not). Alice's in-process turn: bob's interrupt is refused
    by the scope check as it should; then the worker looks for controls it may have
    missed (what it does after every resubscription, and for any control published with
    no marker) and cuts her turn for bob's marker."""
    model = Model()
    loop = AgentLoop(
        RedisBus(redis_factory()),
        ScriptedProvider(handler=model),
        config=LoopConfig(read_block_ms=50),
    )
    task = asyncio.create_task(loop.run())
    client = FrontendClient(redis_factory())
    try:
        await wait_until_async(lambda: _subscribed(loop), timeout_s=10)
        turn = asyncio.create_task(
            loop.process_message(InboundMessage(id="w", content="work", **ROUTE, sender_id="alice"))
        )
        await asyncio.wait_for(model.holding.wait(), 10)
        await client.send(
            InboundMessage(id="b", content="x", followup="interrupt", **ROUTE, sender_id="bob")
        )

        async def bob_refused() -> bool:
            await loop.controls.interrupts.settled()
            return _refused(loop) == 1

        assert await wait_until_async(bob_refused, timeout_s=10)  # the scope check held
        await loop.controls.check_missed()  # (after a resubscription of the control channel)
        model.release.set()
        reply = await asyncio.wait_for(turn, 10)
    finally:
        model.release.set()
        loop.stop()
        await asyncio.wait_for(task, 10)
    assert reply is not None
    assert reply.content == "work done"  # bob's interrupt must not cut alice's turn


async def _subscribed(loop: Any) -> bool:
    listener = getattr(loop, "_listener", None)
    return listener is not None and listener.subscribed.is_set() and loop._consumer is not None


# --- Registry.owned_by: the start's look for its former life's private sessions ---------
async def test_the_starts_look_for_former_private_sessions_skips_one_when_the_registry_moves(
    redis,
) -> None:  # type: ignore[no-untyped-def]
    """``owned_by`` pages the channel's owners registry by rank (ZRANGE start..start+999)
    while other live workers change it: a renewal re-scores a member (ZADD: it moves to
    the end), a loss report or a drop removes one (ZREM). A member removed below the
    page's end between two pages shifts every later member down one rank: the first
    member of the next page is never read. Here 1,000 private sessions of a dead worker
    come first (their records ran out: earliest expiry); a surviving worker reports one
    of them lost between the two pages (owner_lost.lua's ZREM); the restarted worker's
    former session, 1,001st, is skipped: it is not ended, and its record still names
    the live id (the attack ``end_former_private`` exists for)."""
    from bus_redis.registry import Registry
    from bus_redis.results import owner_member

    bus = RedisBus(redis)
    keys = bus.keys
    owners = keys.owners("web")
    dead = {owner_member(f"web:d{i}", "web", f"d{i}"): i for i in range(1000)}
    await redis.zadd(owners, dead)  # (their owner records ran out: no record)
    mine = owner_member("web:mine", "web", "mine")
    await redis.zadd(owners, {mine: 5000})
    await redis.hset(keys.owner("web:mine"), mapping={"worker": "fixed-id"})
    registry = Registry(bus)
    real = {name: getattr(registry.redis, name) for name in ("zrange", "zscan")}
    pages = 0

    def paged(name: str) -> Any:
        async def page(*a: Any, **kw: Any) -> Any:
            nonlocal pages
            got = await real[name](*a, **kw)
            pages += 1
            if pages == 1:  # another worker reports one of the dead one's sessions lost
                await redis.zrem(owners, owner_member("web:d0", "web", "d0"))
            return got

        return page

    for name in real:  # (by rank, as before, or by ZSCAN, as now)
        setattr(registry.redis, name, paged(name))
    try:
        found = await registry.owned_by("fixed-id", ["web"])
    finally:
        for name, method in real.items():
            setattr(registry.redis, name, method)
    assert found == [("web:mine", mine)]  # the former life's session is found


async def test_a_start_run_again_after_failing_between_the_drop_and_the_loss_report_does_not_tell_the_loss(
    redis,
) -> None:  # type: ignore[no-untyped-def]
    """``end_former_private`` deletes the owner record (``abandon_owner``), then reports
    the loss (``report_owner_lost``): two calls. A Redis error between them (a failover,
    a dropped connection) fails the start, which is run again (``_start``: "each step
    safe to run again"); but the retried look (``owned_by``) finds sessions by their
    record, which is gone: the former life's session is never ended by the start. Its
    registry member is left for the owners' sweep at its expiry score, and that loss
    report then deletes whatever the new life answered on the key meanwhile (the attack
    the start's end exists for). Expected: the retried start tells the loss."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    from bus_redis.registry import Registry
    from bus_redis.results import owner_member
    from worker.runtime.registration import end_former_private

    bus = RedisBus(redis)
    keys = bus.keys
    member = owner_member("web:p", "web", "p")
    expiry = 10**13  # (the former life renewed it a moment ago: the sweep waits for this)
    await redis.zadd(keys.owners("web"), {member: expiry})
    await redis.hset(keys.owner("web:p"), mapping={"worker": "fixed-id"})
    registry = Registry(bus)
    real_report = registry.report_owner_lost
    failed = False

    async def flaky(*a: Any, **kw: Any) -> Any:
        nonlocal failed
        if not failed:
            failed = True
            raise RedisConnectionError("Connection reset by peer")  # (TRANSIENT: retried)
        return await real_report(*a, **kw)

    registry.report_owner_lost = flaky  # type: ignore[method-assign]
    abandoned: set[str] = set()  # (the start's own: AgentLoop keeps it across retries)
    # the start fails here (AgentLoop._start, under Backoff.until_done) ...
    with contextlib.suppress(RedisConnectionError):
        await end_former_private(registry, "fixed-id", ["web"], abandoned)
    await end_former_private(registry, "fixed-id", ["web"], abandoned)  # ... and is run again
    assert failed
    assert await redis.zscore(keys.owners("web"), member) is None, "the loss was not told"


# --- subagents: one abort task for every channel -------------------------------------------
async def test_one_channels_stop_flood_holds_back_another_channels_subagent_abort(
    redis_factory,
) -> None:  # type: ignore[no-untyped-def]
    """``Subagents.on_control`` now queues every session to look at in one dict, read by
    ONE task (``_abort_all``: an HGETALL and the drops, a round trip or more each, one
    session after another). Channel ``x``'s frontend publishes a stop for each of 3,000
    sessions that spawned subagents here (``spawned_here`` keeps 10,000 per channel);
    then alice's frontend, on channel ``web``, stops her session: her subagents waiting
    to start are unregistered only after all 3,000 of x's (a round trip each: 10,000
    sessions at 0.5 ms are 5 s, in
    which a queued job of hers may start on another worker). Before, each control had a
    task of its own; the control subscription's own rule is that "a channel that floods
    its controls delays only itself"."""
    from helpers import answering

    loop = AgentLoop(RedisBus(redis_factory()), answering(), config=LoopConfig())
    subagents = loop.subagents
    aborts = subagents.aborts
    try:
        flooded = aborts.spawned_here.setdefault("x", {})
        for i in range(3000):
            flooded[f"x:s{i}"] = None
        aborts.spawned_here["web"] = {"web:alice": None}
        order: list[str] = []
        real_abort = aborts._abort

        async def counted(session: str, at: tuple[int, int]) -> None:
            order.append(session)
            await real_abort(session, at)

        aborts._abort = counted  # type: ignore[method-assign]
        for i in range(3000):  # as the listener of channel x hears them
            subagents.on_control(ControlMessage(op="stop", session_key=f"x:s{i}"))
        subagents.on_control(ControlMessage(op="stop", session_key="web:alice"))
        while loop.rt.background:
            await asyncio.gather(*list(loop.rt.background), return_exceptions=True)
    finally:
        await loop.bus.aclose()
    ahead = order.index("web:alice")
    assert ahead <= 64, f"alice's stop was looked at after {ahead} of channel x's sessions"


# --- the control listener's junk log (held) ------------------------------------------------
def test_one_channels_junk_flood_does_not_hide_another_channels_warning(caplog) -> None:  # type: ignore[no-untyped-def]
    """(Held.) Channel ``x`` floods its control channel with junk; ``web``'s first junk
    control is still warned about at once, and the table of names stays bounded when a
    thousand-odd names come (only subscribed names reach it)."""
    import logging

    from bus_redis import Keys
    from worker.runtime.subscription import JUNK_NAMES, ControlListener

    keys = Keys()
    listener = ControlListener(None, keys, lambda c: None, None)  # type: ignore[arg-type]
    caplog.set_level(logging.WARNING, logger="worker.runtime.subscription")
    for i in range(5_000):
        listener._take({"type": "message", "channel": keys.control("x"), "data": f"junk {i}"})
    listener._take({"type": "message", "channel": keys.control("web"), "data": "junk"})
    warned = [r.getMessage() for r in caplog.records if r.name == "worker.runtime.subscription"]
    assert len(warned) == 2
    assert keys.control("web") in warned[1]
    for i in range(3 * JUNK_NAMES):
        listener._take({"type": "message", "channel": keys.control(f"c{i}"), "data": "junk"})
    assert len(listener._junk) <= JUNK_NAMES + 1
