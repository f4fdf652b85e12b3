"""A private session's close (idle, shutdown) and a scope's history archive, as a second
reader attacked them: a stop or a failed step while closing, ids an operator chose."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import fakeredis
import pytest
import redis.asyncio as aioredis
from helpers import Gate, ScriptedProvider, answering, hold_opening_commit
from pydantic import ValidationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from replies import channel_events, collect, open_private, until, wait_until_async

from bus_redis import FrontendClient, InboundMessage, Keys, OutboundMessage, RedisBus
from bus_redis.codec import fields
from bus_redis.results import Acquired, owner_member
from bus_redis.streams import Retention
from worker import LoopConfig
from worker.agent.providers import LLMResponse

K = Keys()
S = "web:s"


async def _acquired(redis: aioredis.Redis, keep_ms: int) -> tuple[RedisBus, Acquired]:
    client = FrontendClient(redis)
    await client.send(InboundMessage(channel="web", sender_id="u", chat_id="s", content="x"))
    bus = RedisBus(redis, lock_ttl_ms=5000)
    bus.retention = Retention(session_ttl_ms=keep_ms)
    got = await bus.acquire(S, "w1", member=S)
    assert isinstance(got, Acquired)
    return bus, got


async def _now_ms(redis: aioredis.Redis) -> int:
    seconds, micros = await redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


async def _consolidate(bus: RedisBus, got: Acquired, history: str) -> str:
    return await bus.consolidate(
        S, got.token, meta='{"last_consolidated":0}', version=0, scope="web/a",
        memory="facts", memory_version=0, history=history,
    )  # fmt: skip


async def test_archive_trim_counts_from_the_clock_not_from_a_future_entry_id(
    redis: aioredis.Redis,
) -> None:
    """An entry an operator added with an id ahead of the clock (or a Redis whose clock
    was ahead once) makes XADD '*' return that future ms: MINID then drops every genuine
    entry, each far younger than the retention."""
    keep = 60_000
    history = K.memory_history("web/a")
    await redis.xadd(history, {"entry": "a second ago"})
    await redis.xadd(history, {"entry": "operator's"}, id=f"{await _now_ms(redis) + 10 * keep}-0")
    bus, got = await _acquired(redis, keep)
    assert await _consolidate(bus, got, "what was folded") == "ok"
    entries = [fields(f)["entry"] for _, f in await redis.xrange(history)]
    assert "a second ago" in entries


async def test_a_failed_archive_append_moves_no_memory(redis: aioredis.Redis) -> None:
    """(pre-existing, the XADD is older than 4a9a8cc) An archive whose last id is the
    maximal one (an operator's XADD / XSETID) fails the append after the session and
    memory were written: the entry (a [RAW] transcript on a failed `new`) is lost for good
    while last_consolidated moved past its rows."""
    history = K.memory_history("web/a")
    await redis.xadd(
        history, {"entry": "operator's"}, id="18446744073709551615-18446744073709551615"
    )
    bus, got = await _acquired(redis, 60_000)
    assert await _consolidate(bus, got, "[RAW] 2 messages: the rows as they are") == "ok"
    entries = [fields(f)["entry"] for _, f in await redis.xrange(history)]
    assert entries == ["[RAW] 2 messages: the rows as they are"]  # a spent archive replaced
    assert await redis.hget(K.memory("web/a"), "content") == "facts"


async def test_a_stop_during_an_idle_close_still_tells_the_frontend(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """stop() cancels the maintenance task; when it is in close_private between forget
    and abandon, leave() no longer sees the session (forgotten first) and reports
    nothing: no session_lost now, the owner record and registry entry stay until some
    other worker's due_owners (none when this was the channel's last worker)."""

    loop = make_loop(answering(), lock_ttl_ms=1500)
    client = FrontendClient(redis)
    key = await open_private(client, "p")
    reached, never = asyncio.Event(), asyncio.Event()
    abandon, calls = loop.rt.registry.abandon_owner, []

    async def held(*args: Any) -> None:
        calls.append(args)
        if len(calls) == 1:  # the idle close's: held until the stop cancels it
            reached.set()
            await never.wait()
        await abandon(*args)

    loop.rt.registry.abandon_owner = held
    _age(loop, key)  # idle for longer than AGENT_PRIVATE_IDLE_S: the next tick closes it
    await asyncio.wait_for(reached.wait(), 10)  # the next tick closes it
    loop.stop()

    async def left() -> bool:
        return await redis.zscore(K.workers, loop.worker_id) is None

    assert await wait_until_async(left, timeout_s=20)
    codes = [e.code for e in await channel_events(client, "web") if e.session_key == key]
    assert "session_lost" in codes
    assert not await redis.exists(K.owner(key))


async def test_a_careless_message_after_a_failed_abandon_is_not_stored_under_the_private_key(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """Unified mode. close_private forgets the session, then abandon_owner fails (Redis
    blip): the owner record naming this worker stays for the owner TTL. A message of the
    key without require_existing_session then gets acquire's 'private', the worker takes
    S's own lease (its own record, claim '0') and runs a durable turn stored under
    session:S, which ARCHITECTURE says never happens (durable turns of S are U's). Before
    603efc2 the session was still held and answered it privately."""

    loop = make_loop(answering(), unified_session=True)
    client = FrontendClient(redis)
    key = await open_private(client, "p")
    _blip_once(loop.rt.registry, "abandon_owner")
    with pytest.raises(RedisConnectionError):  # the tick logs it and goes on
        await loop.maintenance.close_private(key, "idle")
    assert key in loop.turns.owned()  # closed at the next tick
    careless = InboundMessage(
        channel="web", sender_id="u", chat_id="p", content="no flag", session_key_override=key
    )
    reply = await client.ask(careless, timeout_s=10)
    assert reply.code is None
    assert not await redis.exists(K.session(key))


async def test_an_opening_whose_mark_cannot_be_written_is_dead_lettered(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """The mark is written after the dead-letter gate: an opening whose mark fails on
    every attempt is answered (dead_lettered), not retried for ever."""

    loop = make_loop(answering(), unified_session=True, lock_ttl_ms=300, max_deliveries=1)

    async def refused(member: str) -> None:
        raise ResponseError("value is not an integer or out of range")

    loop.bus.mark_private = refused
    client = FrontendClient(redis)
    _, opened = await client.open_transient("web", "p", session_key="web:p-private")
    got = await collect(client, "web", {opened}, timeout_s=15)
    assert [e.code for e in got[opened] if e.is_terminal] == ["dead_lettered"]


def test_a_retention_past_what_redis_takes_is_refused() -> None:
    with pytest.raises(ValidationError):
        LoopConfig(session_ttl_s=1e17)


async def test_a_message_reaching_a_closing_private_session_is_not_answered_after_its_loss(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """Per-session mode. Between abandon and forget the session is still cached and
    owned, so a message (require_existing_session, as the contract says) read meanwhile
    takes S's lease (claim skipped: closing) and TurnExecution._session finds the cached
    transient session: the closing session runs a turn, and its reply lands after the
    frontend was told session_lost, its text left in S's out stream after the session
    ended (owner_lost emptied it only of what came before)."""
    in_turn, closed = asyncio.Event(), asyncio.Event()

    async def answer(**kw: object) -> LLMResponse:
        in_turn.set()
        await closed.wait()
        return LLMResponse(content="secret answer")

    loop = make_loop(ScriptedProvider(handler=answer))
    client = FrontendClient(redis)
    key = await open_private(client, "p")
    held = Gate(loop.rt.registry.report_owner_lost)
    loop.rt.registry.report_owner_lost = held  # type: ignore[method-assign]
    closing = asyncio.create_task(loop.maintenance.close_private(key, "idle"))
    await held.wait_reached()  # abandoned, not reported yet
    msg = InboundMessage(
        channel="web", sender_id="u", chat_id="p", content="hello", id="m1",
        session_key_override=key, require_existing_session=True,
    )  # fmt: skip
    await client.send(msg)

    async def started_or_answered() -> bool:  # a turn on the closing session, or an answer
        return in_turn.is_set() or not await redis.xlen(K.inbound(key))

    await until(started_or_answered, timeout_s=10)
    held.go.set()
    await asyncio.wait_for(closing, 10)
    closed.set()
    await until(lambda: not loop.turns.running(), timeout_s=10)
    events = [(e.code, e.content) for e in await channel_events(client, "web")
              if e.session_key == key]  # fmt: skip
    assert not in_turn.is_set()  # the model was not called for a session being closed
    assert (None, "secret answer") not in events, events


async def test_a_reopening_during_the_close_is_not_forgotten_by_it(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """Per-session mode. The frontend opens the same key again (session_key=) while the
    idle close is between abandon and report. The opening's commit writes the owner
    record and opened() clears the closing flag; the close's report then finds a record
    (owner_lost: not reported) and close_private forgets the session just reopened: the
    frontend was told transient_opened, yet its next message is session_not_active and
    the record names this worker, which no longer holds (or renews) it."""

    loop = make_loop(answering())
    client = FrontendClient(redis)
    key = await open_private(client, "p")
    held = Gate(loop.rt.registry.report_owner_lost)
    loop.rt.registry.report_owner_lost = held  # type: ignore[method-assign]
    closing = asyncio.create_task(loop.maintenance.close_private(key, "idle"))
    await held.wait_reached()  # abandoned, not reported yet
    _, again = await client.open_transient("web", "p", session_key=key)
    got = await collect(client, "web", {again}, timeout_s=10)
    assert [e.code for e in got[again] if e.is_terminal] == [None]  # transient_opened
    held.go.set()
    await asyncio.wait_for(closing, 10)
    msg = InboundMessage(
        channel="web", sender_id="u", chat_id="p", content="hello", id="m2",
        session_key_override=key, require_existing_session=True,
    )  # fmt: skip
    await client.send(msg)
    got = await collect(client, "web", {"m2"}, timeout_s=10)
    codes = [e.code for e in got["m2"] if e.is_terminal]
    assert codes == [None], [(e.code, e.content) for e in got["m2"]]


async def test_an_opening_dead_lettered_after_a_blip_still_marks_its_key(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """Unified mode. The mark moved after the dead-letter gate: an opening whose first
    attempt failed (here the mark's own write, a Redis blip; as well a kill -9 per
    attempt) is dead-lettered on its last delivery without any mark. The frontend's /new
    for that private key is then no discard: it folds the shared conversation of every
    other chat into memory and deletes it."""
    summaries: list[str] = []

    async def answer(**kw: object) -> LLMResponse:
        if "Summarise" in str(kw["messages"][0]["content"]):  # type: ignore[index]
            summaries.append("folded")
            return LLMResponse(content="the user's name is Ada")
        return LLMResponse(content="ok")

    loop = make_loop(
        ScriptedProvider(handler=answer), unified_session=True, lock_ttl_ms=300, max_deliveries=1
    )
    client = FrontendClient(redis)
    shared = InboundMessage(channel="web", sender_id="u", chat_id="a", content="my name is Ada")
    assert (await client.ask(shared, timeout_s=10)).content == "ok"
    _blip_once(loop.bus, "mark_private")
    key, opened = await client.open_transient("web", "p", session_key="web:p-private")
    got = await collect(client, "web", {opened}, timeout_s=15)
    assert [e.code for e in got[opened] if e.is_terminal] == ["dead_lettered"]
    await client.new(key)  # the user's /new in that chat

    async def marker_reached() -> bool:
        return not await redis.xlen(K.inbound(key))

    await until(marker_reached, timeout_s=10)
    await until(lambda: not loop.turns.running(), timeout_s=10)
    rows = " ".join(await redis.hvals(K.session("unified:default")))
    assert summaries == []
    assert "my name is Ada" in rows


def _age(loop: Any, key: str) -> None:
    """Make a private session look idle for hours (its last use moved back)."""
    loop.rt.turns._used[key] -= 10 * 3600


def _msg(chat: str, text: str, **kw: object) -> InboundMessage:
    return InboundMessage(channel="web", sender_id="u", chat_id=chat, content=text, **kw)  # type: ignore[arg-type]


async def _events(client: FrontendClient, key: str) -> list[tuple[str | None, str | None]]:
    evs = [e for e in await channel_events(client, "web") if e.session_key == key]
    evs.sort(key=lambda e: tuple(int(p) for p in (e.entry_id or "0-0").split("-")))
    return [(e.code, e.content) for e in evs]


async def test_a_session_busy_when_its_turn_in_the_idle_list_comes_is_not_closed_under_its_turn(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """tick() takes the idle list once, then awaits two round trips per close: a message
    of the second idle session read during the first one's close starts a turn, and that
    session, in use again, is not closed (it was: abandoned, reported and forgotten under
    its running turn, whose answer landed after session_lost, left behind)."""
    in_turn, release = asyncio.Event(), asyncio.Event()

    async def answer(**kw: object) -> LLMResponse:
        in_turn.set()
        await release.wait()
        return LLMResponse(content="secret answer")

    loop = make_loop(ScriptedProvider(handler=answer), lock_ttl_ms=1500)
    client = FrontendClient(redis)
    k1, o1 = await client.open_transient("web", "p1", session_key="web:p1")
    k2, o2 = await client.open_transient("web", "p2", session_key="web:p2")
    await collect(client, "web", {o1, o2})
    reached, go = asyncio.Event(), asyncio.Event()
    report, reported = loop.rt.registry.report_owner_lost, []

    async def held(member: str, event: str) -> Any:
        reported.append(member)
        if len(reported) == 1:  # the first idle session's close
            reached.set()
            await go.wait()
        return await report(member, event)

    loop.rt.registry.report_owner_lost = held
    renew, renewed = loop.rt.registry.renew_owner, asyncio.Event()

    async def renew_seen(key: str, *args: Any) -> bool:
        if key == k2:  # the tick went past the idle sessions
            renewed.set()
        return await renew(key, *args)

    loop.rt.registry.renew_owner = renew_seen
    _age(loop, k1)
    _age(loop, k2)
    await asyncio.wait_for(reached.wait(), 10)
    renewed.clear()  # (the maintenance task waits in this tick's first close)
    await client.send(_msg("p2", "hello", id="m2", session_key_override=k2,
                           require_existing_session=True))  # fmt: skip
    await asyncio.wait_for(in_turn.wait(), 10)  # a turn runs on p2
    go.set()
    await asyncio.wait_for(renewed.wait(), 10)  # the tick is done with the idle ones
    release.set()
    await collect(client, "web", {"m2"}, timeout_s=10)
    events = await _events(client, k2)
    codes = [c for c, _ in events]
    assert "session_lost" not in codes  # in use again: not closed
    assert (None, "secret answer") in events
    assert k2 in loop.turns.owned()


async def test_a_failed_owner_drop_at_a_discard_does_not_store_a_durable_session_under_the_private_key(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """Unified mode. discarded() disowns the session first, then drops the owner record;
    a failed drop (Redis blip) leaves the record naming this worker, which forgot the
    session, and the marker's next reach drops nothing (owned is None). A message of the
    key without require_existing_session then gets 'private' and S's own lease (owner =
    us) and runs a durable turn stored under session:S, not unified:default (the bug
    dee1753 fixed for close_private, in the discard path)."""

    loop = make_loop(answering(), unified_session=True, lock_ttl_ms=300)
    client = FrontendClient(redis)
    key = await open_private(client, "p")
    _blip_once(loop.rt.registry, "drop_owner")
    await client.discard(key)
    await until(lambda: key not in loop.turns.owned(), timeout_s=10)
    careless = _msg("p", "no flag", id="c1", session_key_override=key)
    reply = await client.ask(careless, timeout_s=15)
    assert reply.code is None
    assert not await redis.exists(K.session(key))


async def test_an_owner_record_expired_under_a_running_turn_leaves_no_text_after_session_lost(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """The owner's renewals fail (Redis blip) while a turn runs, long enough for the
    record to expire: the session is lost (its worker's own sweep tells the frontend),
    so its running turn is cancelled and the session forgotten (it was kept while a turn
    ran, whose answer then landed after session_lost, its text left behind)."""
    in_turn, release = asyncio.Event(), asyncio.Event()

    async def answer(**kw: object) -> LLMResponse:
        in_turn.set()
        await release.wait()
        return LLMResponse(content="secret answer")

    loop = make_loop(ScriptedProvider(handler=answer), lock_ttl_ms=300, owner_ttl_ms=600)
    client = FrontendClient(redis)
    key = await open_private(client, "p")
    await client.send(_msg("p", "hello", id="m1", session_key_override=key,
                           require_existing_session=True))  # fmt: skip
    await asyncio.wait_for(in_turn.wait(), 10)
    renew = loop.rt.registry.renew_owner

    async def down(*args: Any) -> bool:
        raise RedisConnectionError("Redis went away for a moment")

    loop.rt.registry.renew_owner = down

    async def expired() -> bool:
        return not await redis.exists(K.owner(key))

    await until(expired, timeout_s=10)
    loop.rt.registry.renew_owner = renew  # Redis is back

    async def lost() -> bool:
        return "session_lost" in [c for c, _ in await _events(client, key)]

    await until(lost, timeout_s=10)
    release.set()
    await until(lambda: not loop.turns.running(), timeout_s=10)
    events = await _events(client, key)
    assert (None, "secret answer") not in events  # the turn was cancelled, not answered
    assert "session_lost" in [c for c, _ in events]
    assert key not in loop.turns.owned()


async def test_a_renewal_that_failed_for_the_discarded_session_does_not_cancel_the_reopened_ones_turn(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """renew_owned takes owned() once, then awaits a round trip per key. The renewal of S
    reaches Redis after a discard dropped S's record (answer 0); its answer arrives after
    S was opened again (same key, same worker) and a turn of the new session started.
    Neither `opening` check sees the reopening (it is over): the new session's turn is
    cancelled 'by discard' and the new session forgotten."""
    in_turn, release = asyncio.Event(), asyncio.Event()

    async def answer(**kw: object) -> LLMResponse:
        in_turn.set()
        await release.wait()
        return LLMResponse(content="fresh answer")

    loop = make_loop(ScriptedProvider(handler=answer), lock_ttl_ms=300)
    client = FrontendClient(redis)
    key = await open_private(client, "p")
    renew = loop.rt.registry.renew_owner
    entered, go, answered, deliver = (asyncio.Event() for _ in range(4))
    armed = [True]

    async def slow(k: str, *args: Any) -> bool:
        if k != key or not armed[0]:
            return await renew(k, *args)
        armed[0] = False
        entered.set()
        await go.wait()  # sent after the discard dropped the record
        ok = await renew(k, *args)
        answered.set()
        await deliver.wait()  # answered after the reopening
        return ok

    loop.rt.registry.renew_owner = slow
    try:
        await asyncio.wait_for(entered.wait(), 10)
        await client.discard(key)
        await until(lambda: key not in loop.turns.owned())

        async def dropped() -> bool:
            return not await redis.exists(K.owner(key))

        await until(dropped)
        go.set()
        await asyncio.wait_for(answered.wait(), 10)
        key2, opened2 = await client.open_transient("web", "p", session_key=key)
        assert key2 == key
        await collect(client, "web", {opened2})
        await client.send(_msg("p", "hello", id="m1", session_key_override=key,
                               require_existing_session=True))  # fmt: skip
        await asyncio.wait_for(in_turn.wait(), 10)
        ticks = loop.maintenance.ticks
        deliver.set()
        await until(lambda: loop.maintenance.ticks > ticks)  # the held tick is over
        release.set()
        got = await collect(client, "web", {"m1"}, timeout_s=10)
        codes = [(e.code, e.content) for e in got["m1"]]
        assert (None, "fresh answer") in codes, codes
        assert key in loop.turns.owned()

    finally:  # nothing left held at teardown
        for ev in (go, deliver, release):
            ev.set()


async def test_a_claimless_acquire_built_during_a_close_does_not_delete_the_reopened_record(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """Unified mode. An acquire of S built while S is closing claims nothing ('0'); it
    reaches Redis after S was opened again here (the reopening's commit wrote the record
    naming this worker). acquire.lua takes that live record for stale and deletes it: the
    close's report then finds no record and tells the reopened session's frontend
    session_lost, and its next message gets session_not_active."""

    loop = make_loop(answering(), unified_session=True, lock_ttl_ms=300)
    client = FrontendClient(redis)
    key = await open_private(client, "p")

    report, reached, go_report = (
        loop.rt.registry.report_owner_lost,
        asyncio.Event(),
        asyncio.Event(),
    )
    reported: list[bool] = []

    async def held_report(member: str, event: str) -> bool:
        reached.set()
        await go_report.wait()
        ok = await report(member, event)
        reported.append(ok)
        return ok

    loop.rt.registry.report_owner_lost = held_report
    acquire = loop.rt.bus.acquire
    held, go_acq, acq_done = asyncio.Event(), asyncio.Event(), asyncio.Event()
    armed = [True]

    async def held_acquire(k: str, *args: Any, **kw: Any) -> Any:
        if armed[0] and kw.get("member") == key and not kw.get("claim_owner"):
            armed[0] = False
            held.set()
            await go_acq.wait()
            try:
                return await acquire(k, *args, **kw)
            finally:
                acq_done.set()
        return await acquire(k, *args, **kw)

    loop.rt.bus.acquire = held_acquire
    try:
        loop.rt.turns._used[key] -= 10 * 3600  # idle: the next tick closes it
        await asyncio.wait_for(reached.wait(), 10)  # closing, its record abandoned
        private = {"session_key_override": key, "require_existing_session": True}
        await client.send(_msg("p", "during the close", id="m1", **private))
        await asyncio.wait_for(held.wait(), 10)  # its acquire, built claiming nothing
        _, opened2 = await client.open_transient("web", "p", session_key=key)
        await collect(client, "web", {opened2, "m1"})
        assert await redis.exists(K.owner(key))  # the reopened session's record
        go_acq.set()
        await asyncio.wait_for(acq_done.wait(), 10)
        assert await redis.exists(K.owner(key)), "acquire.lua deleted a live session's record"
        go_report.set()
        await until(lambda: bool(reported))
        assert reported == [False]  # the reopened session is not reported lost
        reply = await client.ask(_msg("p", "after the reopening", id="m2", **private), timeout_s=10)
        assert (reply.code, reply.content) == (None, "ok")
    finally:  # nothing left held at teardown
        go_acq.set()
        go_report.set()


def _pmsg(chat: str, text: str, key: str, mid: str) -> InboundMessage:
    return InboundMessage(
        channel="web", sender_id="u", chat_id=chat, content=text, id=mid,
        session_key_override=key, require_existing_session=True,
    )  # fmt: skip


async def test_a_pubsub_discards_late_drop_does_not_delete_the_reopened_sessions_record(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per-session mode. A discard over pub/sub reaches a running turn of private S:
    Controls._apply forgets S and *spawns* the drop of its owner record (nobody waits for
    it). The holder goes on: the turn is cancelled, the marker reached, and the frontend
    opens S again (transient_opened, the commit writes the record naming this worker).
    The old drop lands after that: owner.lua deletes the record (it names this worker),
    empties S's out stream and ZREMs the registry member, which the new session shares.
    The next renewal finds no record and forgets the reopened session; its loss is never
    told (no registry entry for the owners' sweep)."""
    in_turn, release = asyncio.Event(), asyncio.Event()

    async def answer(**kw: object) -> LLMResponse:
        if "first" in json.dumps(kw.get("messages")):
            in_turn.set()
            await release.wait()
        return LLMResponse(content="ok")

    loop = make_loop(ScriptedProvider(handler=answer))
    client = FrontendClient(redis)
    key = await open_private(client, "p")
    drop, calls = type(loop.rt).drop_owner, []
    drop_reached, drop_go = asyncio.Event(), asyncio.Event()

    async def held(rt: Any, *args: Any) -> None:
        calls.append(args)
        if len(calls) == 1:  # the drop task spawned by Controls._apply, run late (once
            drop_reached.set()  # sent, its script precedes any later commit on the
            await drop_go.wait()  # one ordered connection the scripts share)
        await drop(rt, *args)

    monkeypatch.setattr(type(loop.rt), "drop_owner", held)
    await client.send(_pmsg("p", "first", key, "m1"))
    await asyncio.wait_for(in_turn.wait(), 10)
    await client.discard(key)
    await asyncio.wait_for(drop_reached.wait(), 10)
    got = await collect(client, "web", {"m1"}, timeout_s=10)
    assert [e.code for e in got["m1"] if e.is_terminal] == ["cancelled"]

    async def marker_reached() -> bool:
        return not await redis.xlen(K.inbound(key))

    await until(marker_reached, timeout_s=10)
    _, again = await client.open_transient("web", "p", session_key=key)
    got = await collect(client, "web", {again}, timeout_s=10)
    assert [e.code for e in got[again] if e.is_terminal] == [None]  # transient_opened
    assert await redis.hget(K.owner(key), "worker") == loop.worker_id
    drop_go.set()  # the discard's drop of the *earlier* session lands now
    await until(lambda: len(calls) == 1 and not loop.controls._drops, timeout_s=10)
    member = owner_member(key, "web", "p")
    assert await redis.hget(K.owner(key), "worker") == loop.worker_id, "record deleted"
    assert await redis.zscore(K.owners("web"), member) is not None, "registry entry gone"


def _blip_once(holder: Any, name: str) -> None:
    """``holder.<name>`` fails once, as in a Redis blip, and is itself again after."""
    real = getattr(holder, name)

    async def blip(*_args: Any) -> None:
        setattr(holder, name, real)
        raise RedisConnectionError("Redis went away for a moment")

    setattr(holder, name, blip)


async def _discarded_while_redis_blips(a: Any, client: FrontendClient) -> tuple[str, list[bool]]:
    """A private session on worker ``a``, discarded while Redis refuses ``a``'s drop of its
    owner record (a blip): the drop is kept for a retry. ``failing[0] = False`` ends it."""
    key = await open_private(client, "p")
    drop, failing = a.rt.registry.drop_owner, [True]

    async def blip(*args: Any) -> None:
        if failing[0]:
            raise ConnectionError("Redis went away for a moment")
        await drop(*args)

    a.rt.registry.drop_owner = blip
    await client.discard(key)
    await until(lambda: a.turns.redropping(), timeout_s=10)  # the marker's drop failed
    return key, failing


async def test_a_failed_drop_is_not_left_behind_by_a_graceful_stop(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """Worker A's holder reaches a discard marker of its private S; the drop of the owner
    record fails (a blip) and is kept for a retry (Runtime.drop_owner: each tick, before
    an acquire). A is then stopped gracefully: leave() abandons the *owned* sessions only,
    never the redrops, so the record naming A (which holds nothing, and is gone) stays for
    the owner TTL. S opened again on worker B meanwhile: B's acquire answers 'forward'
    to A, and the opening waits in a dead worker's inbox."""

    a = make_loop(answering())
    client = FrontendClient(redis)
    key, failing = await _discarded_while_redis_blips(a, client)
    leave = a.maintenance.leave

    async def leaving() -> None:  # Redis is back once the worker leaves
        failing[0] = False
        await leave()

    a.maintenance.leave = leaving
    a.stop()

    async def left() -> bool:
        return await redis.zscore(K.workers, a.worker_id) is None

    await until(left, timeout_s=20)
    assert await redis.hget(K.owner(key), "worker") is None  # leave() retried the drop
    # (on fakeredis, A's blocked read of the ready queue may still take the reopening's
    # notification: B's sweep of stranded streams finds it, each third of B's lease TTL)
    b = make_loop(answering(), lock_ttl_ms=1500)
    _, again = await client.open_transient("web", "p", session_key=key)
    try:
        await collect(client, "web", {again}, timeout_s=25)
    except AssertionError:
        owner = await redis.hget(K.owner(key), "worker")
        raise AssertionError(
            f"reopening not answered by {b.worker_id}: the record still names {owner} "
            f"(stopped: {owner == a.worker_id})"
        ) from None


async def test_a_late_redrop_of_worker_a_keeps_worker_bs_registry_entry(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """A's drop of S's record failed (kept for a retry); A's record then runs out (here:
    deleted, as its TTL would) and S is reopened on B. A's retry (renew_owned) runs
    owner.lua 'drop': it leaves B's record alone (cur ~= A), but ZREMs the registry member
    unconditionally, the same member B's session has (same key, channel, chat): B's
    session is out of the owners' registry until B's next renewal, and should B die
    meanwhile its frontend is never told session_lost."""

    a = make_loop(answering(), lock_ttl_ms=60_000)  # ticks: rare
    client = FrontendClient(redis)
    key, failing = await _discarded_while_redis_blips(a, client)
    await redis.delete(K.owner(key))  # A's record ran out
    a.stop()  # (A's worker goes on as a stalled process would; only its redrop matters)
    a.maintenance.leave = _nothing  # type: ignore[method-assign]
    # A took the reopening's notification as a stalled worker would: B's sweep of stranded
    # streams finds it, each third of B's lease TTL
    b = make_loop(answering(), lock_ttl_ms=1500)
    _, again = await client.open_transient("web", "p", session_key=key)
    await collect(client, "web", {again}, timeout_s=10)
    assert await redis.hget(K.owner(key), "worker") == b.worker_id
    member = owner_member(key, "web", "p")
    assert await redis.zscore(K.owners("web"), member) is not None
    failing[0] = False
    await a.maintenance.renew_owned.__func__(a.maintenance)  # A's late retry
    assert await redis.hget(K.owner(key), "worker") == b.worker_id
    assert await redis.zscore(K.owners("web"), member) is not None, "B's entry ZREM'd by A"


async def _nothing() -> None:
    return None


def _fake(redis: aioredis.Redis) -> bool:
    return isinstance(redis, fakeredis.FakeAsyncRedis)


async def _reading(redis: aioredis.Redis) -> bool:
    """Whether a client of the server is blocked in an XREAD (fakeredis reads inside this
    process: a yield lets it start)."""
    if _fake(redis):
        await asyncio.sleep(0)
        return True
    clients = await redis.client_list()
    return any(c.get("cmd") == "xread" and "b" in c.get("flags", "") for c in clients)


@pytest.mark.parametrize("unified", [False, True])
async def test_a_discard_racing_the_opening_commit_ends_the_session_everywhere(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop, unified: bool
) -> None:
    """The discard is published while the opening commit (the one that writes the owner
    record) is on its way: its pub/sub message finds the session owned but not yet
    recorded, its marker sits behind the opening entry. Once both have landed the session
    is gone everywhere: not held in memory, no owner record, no registry entry, no loss
    told later, and a message for it is refused; the next opening starts afresh."""

    loop = make_loop(answering(), unified_session=unified)
    held = hold_opening_commit(loop)
    client = FrontendClient(redis)
    key, opened = await client.open_transient("web", "p", session_key="web:p")
    await held.wait_reached()
    assert await client.discard(key) >= 1  # the pub/sub message reached the worker
    await until(lambda: not loop.controls._drops, timeout_s=10)  # its drop, if any, done
    seen: list[OutboundMessage] = []

    # a real server: blocked until events come (a timeout left gaps between reads, in
    # which the answer could be written and the discard delete it: a reader not reading);
    # fakeredis holds its server while a read blocks, so there it reads again and again
    block = 100 if _fake(redis) else 0

    async def follow() -> None:  # a frontend reading the events live, as README says
        last = "0-0"
        while not any(e.reply_to == opened and e.is_terminal for e in seen):
            for _, entries in await redis.xread({K.out(key): last}, block=block) or []:
                for entry_id, f in entries:
                    last = entry_id
                    seen.append(OutboundMessage.model_validate_json(fields(f)["payload"]))

    following = asyncio.create_task(follow())
    await until(lambda: _reading(redis), timeout_s=10)  # its XREAD waits in the server
    held.go.set()
    await asyncio.wait_for(following, 10)  # the opening was answered, to a live reader
    assert [e.code for e in seen if e.reply_to == opened] == [None]  # transient_opened

    async def settled() -> bool:  # the marker reached, the session forgotten, its record gone
        gone = not await redis.xlen(K.inbound(key)) and not await redis.exists(K.owner(key))
        return gone and not loop.rt.turns.owns(key)

    await until(settled, timeout_s=10)
    await until(lambda: not loop.controls._drops and not loop.turns.redropping(), timeout_s=10)
    assert await redis.zscore(K.owners("web"), owner_member(key, "web", "p")) is None
    reply = await client.ask(_pmsg("p", "still here?", key, "m1"), timeout_s=10)
    assert reply.code == "session_not_active"
    await loop.maintenance.tick()  # nothing is told lost about a session that was discarded
    assert "session_lost" not in [code for code, _ in await _events(client, key)]
    loop.bus.commit = held.target
    _, again = await client.open_transient("web", "p", session_key=key)
    await collect(client, "web", {again}, timeout_s=10)
    reply = await client.ask(_pmsg("p", "and now?", key, "m2"), timeout_s=10)
    assert (reply.code, reply.content) == (None, "ok")
