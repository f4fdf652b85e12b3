"""A hostile second reading of ebacb12..HEAD (private ends as inbound entry ids, the
provisional end of an open private session). Each test fails on HEAD for the defect its
docstring names and states the behaviour expected instead. (A `new` published in the
very millisecond a private session ended, on a stream drained, deleted and started
again within that millisecond, is still taken as the private session's: ARCHITECTURE,
known; its test is not here.)

No test sleeps to synchronise: each waits on a condition with a bound."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import redis.asyncio as aioredis
from replies import open_private, until
from test_private_beside_durable import _durable_then_private, _summarising

from bus_redis import FrontendClient, Keys
from bus_redis.registry import lost_event

K = Keys()
QUIET = {"lock_ttl_ms": 60_000, "owner_ttl_ms": 60_000}  # no owners' sweep mid-test
MAX_ID = "18446744073709551615-18446744073709551615"


def _folded(provider: Any) -> bool:
    """Whether the model was asked for a summary (a ``new`` folding a stored session)."""
    return any(str(c["messages"][0]["content"]).startswith("Summarise") for c in provider.calls)


async def _drained(redis: aioredis.Redis, key: str) -> None:
    async def drained() -> bool:
        return not await redis.xlen(K.inbound(key))

    await until(drained, timeout_s=10)


def _final(end: str | None) -> bool:
    return end is not None and "|" not in end


# --- 1. an end read from a junk entry id outlives the stream that held it -------------


@pytest.mark.parametrize("junk_id", [MAX_ID, "far-future"])
async def test_a_junk_entry_id_after_a_private_end_makes_every_later_new_a_discard(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop, junk_id: str
) -> None:
    """Defect (``_events.lua`` ``write_private_end``, ``registry.published_before``): the
    end of a private session is now the id of the last entry of its inbound stream, and
    that id is compared with ``new`` markers of *later* streams of the key (the stream
    is deleted once drained: ``_common.lua`` ``try_release``, ``commit.lua`` "sole").
    A frontend may XADD explicit ids (the code says so: ``_common.lua`` MAX_ID): a junk
    entry at the maximal id, or at a far-future id, queued after the private session's
    ``discard`` becomes its end. Once the junk is rejected and the stream drained, every
    ``new`` of the stored (durable) chat on that key for the next day gets an ordinary
    id, ``<=`` that end, and is taken for the private session's: a discard; the stored
    history is neither summarised nor cleared (on ebacb12 the end was Redis time, which
    a junk id could not move).
    Expected: a ``new`` published after the private session ended (its stream drained,
    a later publish) folds and clears the stored session: an end is never later than the
    time it was written (e.g. keep ``<Redis ms>`` beside the id, or compare ids only
    within the stream that held the end)."""
    provider = _summarising()
    make_loop(provider, **QUIET)
    client = FrontendClient(redis)
    key = await _durable_then_private(client, "jk")
    if junk_id != MAX_ID:
        junk_id = f"{int(time.time() * 1000) + 86_400_000}-0"  # a day ahead
    # the private chat's discard, and a junk entry the same frontend wrote after it
    async with redis.pipeline(transaction=True) as pipe:
        client.queue_control(pipe, "discard", key)
        pipe.xadd(K.inbound(key), {"payload": "junk"}, id=junk_id)
        await pipe.execute()
    await _drained(redis, key)
    end = await redis.get(K.private_end(key))
    assert _final(end)
    assert not await redis.exists(K.inbound(key))  # drained: the stream is gone
    assert await redis.hexists(K.session(key), "meta")  # the durable chat is stored
    # later: the user's /new of the (durable) chat, on a fresh stream
    await client.new(key)
    await _drained(redis, key)
    assert _folded(provider), (
        f"a new published after the private session ended was taken for its own (the end "
        f"{end!r} came from a junk entry id): the stored chat was not summarised"
    )
    assert not await redis.hexists(K.session(key), "meta"), "nor cleared"


# --- 2. ids of a deleted and recreated stream: the tie is back ---------------------------


# --- 3. a late loss report of the previous private session overwrites the provisional end


async def test_a_loss_report_between_an_opening_and_its_commit_leaves_the_new_session_no_provisional_end(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """Defect (``owner_lost.lua`` writes the end unconditionally; the opening's
    provisional end is written once, before its commit, and renewals only PEXPIRE it):
    private session P1 on ``web:lr`` (beside a stored chat) loses its worker; before
    any owners' sweep reports it, the user opens a private session P2 on the key again
    (same registry member: key, channel, chat). A survivor's sweep that reports P1's
    loss between P2's ``open`` (its provisional end) and P2's commit (its record)
    finds no record, removes the member and writes a final end over P2's provisional
    one. P2 is then open with a final end that no renewal rewrites: when P2's worker is
    killed too, the user's ``/new`` of P2 (no loss reported) finds a final end earlier
    than the marker and folds and deletes the stored session beside it -- the window the
    change claims to close ("a worker killed with a private session open leaves no
    window in which its ``new`` folds the stored session beside it").
    Simulated: the kills as ``test_private_known_gaps`` does (the worker forgets the
    session, its record is gone, its registry entry stays), the survivor's report run
    right after P2's ``opening_owner``.
    Expected: the stored session stays (the ``new`` was P2's): a loss report does not
    overwrite the provisional end of a newer opening (e.g. skip a provisional end whose
    ms lies ahead), or the commit that writes the record writes the provisional end."""
    provider = _summarising()
    loop = make_loop(provider, **QUIET)
    client = FrontendClient(redis)
    key = await _durable_then_private(client, "lr")
    member = loop.turns.owned()[key]
    loop.rt.forget(key)  # P1's worker killed: its record runs out, no report yet
    await redis.delete(K.owner(key))
    assert await redis.zscore(K.owners("web"), member) is not None
    registry = loop.rt.registry
    opening = registry.opening_owner
    reported: list[bool] = []

    async def opening_then_a_survivors_sweep(k: str, m: str) -> None:
        await opening(k, m)
        if not reported:  # the sweep of another worker, at that moment
            reported.append(await registry.report_owner_lost(m, lost_event(m)))

    registry.opening_owner = opening_then_a_survivors_sweep  # type: ignore[method-assign]
    assert await open_private(client, "lr") == key  # P2
    assert reported == [True]
    assert await redis.exists(K.owner(key))  # P2 is open
    member2 = loop.turns.owned()[key]
    loop.rt.forget(key)  # P2's worker killed as well, its loss not reported yet
    await redis.delete(K.owner(key))
    assert await redis.zscore(K.owners("web"), member2) is not None
    await client.new(key)  # the user's /new in P2
    await _drained(redis, key)
    end = json.dumps(await redis.get(K.private_end(key)))
    assert not _folded(provider), f"P2's new summarised the stored session (end {end})"
    assert await redis.hexists(K.session(key), "meta"), (
        f"a new of the open private session P2 deleted the stored session beside it "
        f"(its end: {end})"
    )
