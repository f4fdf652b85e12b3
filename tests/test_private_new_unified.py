"""Unified mode: a `new` published on a private chat's key is a discard of that private
session, also once the session has ended (closed when idle, its worker gone): it never
reaches the shared conversation every other chat stores under `unified:default`."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis
from helpers import Gate, ScriptedProvider, answering, hold_opening_commit, opening_commit
from replies import collect, open_private, wait_until_async

from bus_redis import FrontendClient, InboundMessage, Keys
from worker.agent.providers import LLMResponse

K = Keys()
UNIFIED = "unified:default"


def _msg(chat: str, text: str, **kw: object) -> InboundMessage:
    return InboundMessage(channel="web", sender_id="u", chat_id=chat, content=text, **kw)  # type: ignore[arg-type]


async def test_new_on_an_ended_private_key_leaves_the_shared_conversation(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    summaries: list[str] = []

    async def answer(**kw: object) -> LLMResponse:
        messages = kw["messages"]
        if "Summarise" in str(messages[0]["content"]):  # type: ignore[index]
            summaries.append(str(messages))
            return LLMResponse(content="the user's name is Ada")
        return LLMResponse(content="ok")

    loop = make_loop(ScriptedProvider(handler=answer), unified_session=True)
    client = FrontendClient(redis)
    assert (await client.ask(_msg("a", "my name is Ada"), timeout_s=10)).content == "ok"
    key, _ = await client.open_transient("web", "p", session_key="web:p")
    private = {"session_key_override": key, "require_existing_session": True}
    assert (await client.ask(_msg("p", "a secret", **private), timeout_s=10)).content == "ok"

    await loop.maintenance.close_private(key, "idle")  # the private session ends
    assert key not in loop.turns.owned()

    async def lease_free() -> bool:  # the marker is then reached under the unified key
        return not await redis.exists(K.lease(key))

    assert await wait_until_async(lease_free, timeout_s=10)
    await client.new(key)  # a frontend that publishes `new` for a private chat's /new

    async def marker_reached() -> bool:
        return not await redis.xlen(K.inbound(key))

    assert await wait_until_async(marker_reached, timeout_s=10)
    assert (await client.ask(_msg("a", "who am I?"), timeout_s=10)).content == "ok"
    rows = " ".join(await redis.hvals(K.session(UNIFIED)))
    assert "my name is Ada" in rows  # the shared conversation is kept
    assert summaries == []  # and was not folded into memory
    assert "a secret" not in rows


async def test_a_private_key_stays_marked_when_its_owner_record_runs_out(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """The mark is written before the opening commit and outlives the owner record: a
    worker killed before it could drop the record (or the marker) leaves the key marked."""
    summaries: list[str] = []

    async def answer(**kw: object) -> LLMResponse:
        if "Summarise" in str(kw["messages"][0]["content"]):  # type: ignore[index]
            summaries.append("folded")
        return LLMResponse(content="ok")

    loop = make_loop(ScriptedProvider(handler=answer), unified_session=True, session_ttl_s=3600)
    client = FrontendClient(redis)
    assert (await client.ask(_msg("a", "my name is Ada"), timeout_s=10)).content == "ok"
    key = await open_private(client, "p")
    assert 3600_000 < await redis.pttl(K.private_mark(key)) <= 3600_000 + 15_000
    # the state a kill -9 leaves once the owner record ran out: no record, no owner here
    loop.rt.forget(key)
    await redis.delete(K.owner(key))
    await client.new(key)

    async def marker_reached() -> bool:
        return not await redis.xlen(K.inbound(key))

    assert await wait_until_async(marker_reached, timeout_s=10)
    assert (await client.ask(_msg("a", "who am I?"), timeout_s=10)).content == "ok"
    assert "my name is Ada" in " ".join(await redis.hvals(K.session(UNIFIED)))
    assert summaries == []


async def test_new_on_a_chat_never_private_still_folds_the_shared_conversation(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """The mark is per key: a durable chat's `new` is nanobot's /new of the shared session."""

    async def answer(**kw: object) -> LLMResponse:
        if "Summarise" in str(kw["messages"][0]["content"]):  # type: ignore[index]
            return LLMResponse(content="the user's name is Ada")
        return LLMResponse(content="ok")

    make_loop(ScriptedProvider(handler=answer), unified_session=True)
    client = FrontendClient(redis)
    assert (await client.ask(_msg("a", "my name is Ada"), timeout_s=10)).content == "ok"
    _, opened = await client.open_transient("web", "p", session_key="web:p")  # another key
    await collect(client, "web", {opened})
    await client.new("web:b")
    assert (await client.ask(_msg("b", "who am I?"), timeout_s=10)).content == "ok"
    rows = " ".join(await redis.hvals(K.session(UNIFIED)))
    assert "my name is Ada" not in rows
    assert await redis.hget(K.session(UNIFIED), "count") == "2"


async def test_the_mark_is_renewed_with_the_owner_record_and_outlives_the_session(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    loop = make_loop(answering(), session_ttl_s=3600, unified_session=True)
    client = FrontendClient(redis)
    key = await open_private(client, "p")
    await redis.delete(K.private_mark(key))  # a session opened before marks existed
    member = loop.turns.owned()[key]
    assert await loop.rt.registry.renew_owner(key, loop.worker_id, member)
    assert 3600_000 < await redis.pttl(K.private_mark(key)) <= 3600_000 + 15_000
    await loop.maintenance.close_private(key, "idle")
    assert 3590_000 < await redis.pttl(K.private_mark(key)) <= 3600_000
    assert not await redis.exists(K.owner(key))


async def test_marks_are_bounded_in_time_and_made_in_unified_mode_only(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """Sessions kept for good (AGENT_SESSION_TTL_S=0) do not keep marks for good: 90 days.
    In per-session mode nothing reads a mark, so none is written (a key naming the chat)."""

    make_loop(answering(), session_ttl_s=0, unified_session=True)
    client = FrontendClient(redis)
    key = await open_private(client, "p")
    assert 90 * 86_400_000 < await redis.pttl(K.private_mark(key)) <= 90 * 86_400_000 + 15_000
    await client.discard(key)

    async def ended() -> bool:
        return not await redis.exists(K.owner(key))

    assert await wait_until_async(ended, timeout_s=10)
    assert 0 < await redis.pttl(K.private_mark(key)) <= 90 * 86_400_000


async def test_per_session_mode_writes_no_mark(redis: aioredis.Redis, make_loop) -> None:  # type: ignore[no-untyped-def]
    make_loop(answering())
    client = FrontendClient(redis)
    key, opened = await client.open_transient(
        "web", "u1-t-0123abcd", session_key="web:u1-t-0123abcd"
    )
    await collect(client, "web", {opened})
    await client.discard(key)

    async def ended() -> bool:
        return not await redis.exists(K.owner(key))

    assert await wait_until_async(ended, timeout_s=10)
    assert not await redis.exists(K.private_mark(key))


async def test_a_renewal_during_the_opening_commit_keeps_the_session(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """The worker owns a private session from its opening, before the commit writes the
    owner record: a maintenance tick in between finds no record and must not drop it."""

    loop = make_loop(answering())
    held = hold_opening_commit(loop)
    client = FrontendClient(redis)
    key, opened = await client.open_transient("web", "p", session_key="web:p")
    await held.wait_reached()
    assert not await redis.exists(K.owner(key))
    await loop.maintenance.tick()  # renews what the worker owns: no record yet
    held.go.set()
    await collect(client, "web", {opened})
    private = {"session_key_override": key, "require_existing_session": True}
    reply = await client.ask(_msg("p", "still here?", **private), timeout_s=10)
    assert (reply.code, reply.content) == (None, "ok")


async def test_a_closed_private_session_is_not_claimed_again_by_its_own_worker(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """Closing a private session reports it lost, which re-notifies its stream; the worker
    reads that notification while closing: its acquire must not claim the session (and
    write the owner record again), which the worker has forgotten by then."""

    loop = make_loop(answering())
    client = FrontendClient(redis)
    key = await open_private(client, "p")
    report = loop.rt.registry.report_owner_lost

    async def report_then_wait(member: str, event_json: str) -> bool:
        reported = await report(member, event_json)

        async def notification_served() -> bool:  # acquired (and released) by the worker
            return not await redis.xlen(K.ready("web"))

        assert await wait_until_async(notification_served, timeout_s=10)
        return reported

    loop.rt.registry.report_owner_lost = report_then_wait
    await loop.maintenance.close_private(key, "idle")
    assert not await redis.exists(K.owner(key))
    assert key not in loop.turns.owned()


async def test_new_covering_a_queued_open_is_no_fold_of_the_shared_conversation(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """The user's /new (published as `new`) comes before the worker got to the opening
    (the unified holder is busy with another chat's turn): the opening is cancelled, and
    the key is marked all the same, so the `new` folds nothing (a second reader's test)."""
    summaries: list[str] = []
    gate, busy = asyncio.Event(), asyncio.Event()

    async def answer(**kw: object) -> LLMResponse:
        messages = kw["messages"]
        if "Summarise" in str(messages[0]["content"]):  # type: ignore[index]
            summaries.append("folded")
            return LLMResponse(content="the user's name is Ada")
        if "hold on" in str(messages[-1]["content"]):  # type: ignore[index]
            busy.set()
            await gate.wait()
        return LLMResponse(content="ok")

    make_loop(ScriptedProvider(handler=answer), unified_session=True)
    client = FrontendClient(redis)
    assert (await client.ask(_msg("a", "my name is Ada"), timeout_s=10)).content == "ok"
    held = await client.send(_msg("a", "hold on"))  # the unified holder is busy with it
    await asyncio.wait_for(busy.wait(), 10)
    key, opened = await client.open_transient("web", "p", session_key="web:p")
    await client.new(key)
    gate.set()
    got = await collect(client, "web", {held, opened})
    assert [e.code for e in got[opened] if e.is_terminal] == ["cancelled"]

    async def marker_reached() -> bool:
        return not await redis.xlen(K.inbound(key))

    assert await wait_until_async(marker_reached, timeout_s=10)
    assert (await client.ask(_msg("a", "who am I?"), timeout_s=10)).content == "ok"
    assert summaries == []
    assert "my name is Ada" in " ".join(await redis.hvals(K.session(UNIFIED)))


async def test_a_renewal_answered_after_the_opening_commit_keeps_the_session(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """The renewal runs in Redis before the opening commit (no record yet) but its answer
    is read after the commit's: the tick looked at the opening before it asked, and keeps
    the session (a second reader's test)."""

    loop = make_loop(answering())
    renewed, opened_now = asyncio.Event(), asyncio.Event()
    opened, renew = loop.turns.opened, loop.rt.registry.renew_owner
    held = Gate(loop.bus.commit, when=opening_commit)

    def opened_hook(key: str) -> None:
        opened(key)
        opened_now.set()

    async def late_answer(key: str, worker_id: str, member: str) -> bool:
        done = await renew(key, worker_id, member)  # runs in Redis now: no record yet
        renewed.set()
        await opened_now.wait()  # ... its answer is read after the commit's
        return done

    loop.bus.commit, loop.turns.opened = held, opened_hook
    loop.rt.registry.renew_owner = late_answer
    client = FrontendClient(redis)
    key, first = await client.open_transient("web", "p", session_key="web:p")
    await held.wait_reached()
    tick = asyncio.create_task(loop.maintenance.tick())
    await asyncio.wait_for(renewed.wait(), 10)
    held.go.set()
    await asyncio.wait_for(tick, 10)
    await collect(client, "web", {first})
    assert await redis.hget(K.owner(key), "worker") == loop.worker_id
    assert key in loop.turns.owned()
