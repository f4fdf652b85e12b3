"""A hostile second reading of stop 52's product changes (helper): heartbeat.lua's claim
check and the woken twin's stop, controls' look, the interrupt memo as a range and
markers.lua passing interrupt markers over, the subagent and consolidation jobs, owned_by
by ZSCAN, and ``channels remove``'s refusal."""

from __future__ import annotations

import signal

import pytest
from replies import channel_events, collect, until
from test_interrupt_scope import _alice_working, _cut, _refused
from test_kill_chaos import _beats_since, _close, _m, _terminals, _worker
from test_second_reading_stop51 import _held_publish
from workers import WorkerProcess

from bus_redis import FrontendClient, InboundMessage, Keys

K = Keys()


# --- 1. the woken twin's stop -------------------------------------------------------------


@pytest.mark.real_redis
@pytest.mark.slow
async def test_a_woken_twin_leaves_the_private_session_its_twin_serves_on_the_key(
    redis_server, real_redis, fake_llm
) -> None:  # type: ignore[no-untyped-def]
    """The first process under an id owns private session K and is stopped (SIGSTOP) past
    its record (and past its ``AGENT_PRIVATE_IDLE_S``: a VM paused an hour, here 2 s);
    the twin started under the id ends that session at its start (``session_lost``); the
    user opens a private session on K again, now the twin's (its owner record names the
    same id; the registry member is [key, channel, chat], the same too). The first process
    is woken: its heartbeat finds the id claimed, ``on_id_taken`` only asks for a stop,
    and the rest of that maintenance tick would run on: ``close_idle`` closing K (idle
    here) with owner.lua 'abandon', which checks the record's worker id only, would delete
    the twin's record with the session's events. Held in these runs: the stop cancels
    the maintenance task within a few loop turns (a drain with nothing left to run), the
    held durable turn's lease loss being seen before the heartbeat. Expected (loop.py: "leaving what names the id alone (the
    other's)"): the woken process exits 2 and the twin's private session lives on: its
    next message answered inside it, its owner record still there."""
    url = redis_server.url
    old = _worker(url, "twin5", fake_llm, {"AGENT_PRIVATE_IDLE_S": "2"})
    new: WorkerProcess | None = None
    try:
        await until(lambda: _beats_since(real_redis, "twin5", 0), timeout_s=20)
        client = FrontendClient(real_redis)
        key, opened = await client.open_transient("web", "rk", session_key="web:rk-p")
        await collect(client, "web", {opened}, timeout_s=20)
        # a durable turn of another chat held at the model: the woken one drains it (its
        # grace period) while its maintenance ticks on
        held: list[str] = []
        fake_llm.on_block = held.append
        await client.send(_m("dr", "dr-1", "[dr] block durable"))
        await until(lambda: len(held) >= 1, timeout_s=20)
        old.signal(signal.SIGSTOP)

        async def record_gone() -> bool:
            return not await real_redis.exists(K.worker_info("twin5"))

        await until(record_gone, timeout_s=20)
        new = _worker(url, "twin5", fake_llm)

        async def lost() -> bool:
            return any(
                e.code == "session_lost" and e.session_key == key
                for e in await channel_events(client, "web")
            )

        await until(lost, timeout_s=20)
        # the user opens a private session on K again: the twin's
        key, reopened = await client.open_transient("web", "rk", session_key="web:rk-p")
        await collect(client, "web", {reopened}, timeout_s=20)
        first = await client.send(
            _m("rk", "rk-1", "[rk] remember 7", session_key_override=key,
               require_existing_session=True)
        )  # fmt: skip
        got = await collect(client, "web", {first}, timeout_s=20)
        assert [(e.type, e.code) for e in _terminals(got, first)] == [("message", None)]
        assert await real_redis.hget(K.owner(key), "worker") == "twin5"
        lost_before = sum(e.code == "session_lost" for e in await channel_events(client, "web"))
        old.signal(signal.SIGCONT)
        await until(lambda: old.proc.poll() is not None, timeout_s=30)
        assert old.proc.returncode == 2, old.log()[-2000:]
        assert new.proc.poll() is None
        record = await real_redis.hget(K.owner(key), "worker")
        lost_after = sum(e.code == "session_lost" for e in await channel_events(client, "web"))
        after = await client.send(
            _m("rk", "rk-2", "[rk] and now?", session_key_override=key,
               require_existing_session=True)
        )  # fmt: skip
        got = await collect(client, "web", {after}, timeout_s=20)
        answers = [(e.type, e.code) for e in _terminals(got, after)]
        assert (record, lost_after, answers) == ("twin5", lost_before, [("message", None)]), (
            f"the woken process (exit 2) closed its twin's live private session on the key: "
            f"owner record after its stop {record!r}, session_lost events {lost_before} -> "
            f"{lost_after}, next message answered {answers}"
        )
    finally:
        _close({"old twin": old, "new twin": new})


# --- 3. the interrupt memo as a range ------------------------------------------------------


async def test_the_owners_interrupt_between_two_foreign_ones_read_in_two_passes_is_refused_unread(
    redis_factory,
) -> None:  # type: ignore[no-untyped-def]
    """The memo is now a range: ``_read`` merges a pass's (earliest, latest) with the
    one kept, so two passes that each read one marker leave the whole span between them
    as "read". Bob interrupts alice's turn (marker Mb1, read, refused); alice's replica
    writes her interrupt transaction (Ma > Mb1) and is slow to PUBLISH; bob interrupts
    again (Mb2 > Ma: read from Mb2 on, refused); the memo is now (Mb1, Mb2). Alice's
    PUBLISH arrives: Ma lies between, and is refused unread ("a marker already looked
    at"), though no walk ever read it (the first ran before it was written, the second
    began after it). ARCHITECTURE: "an earlier one is read (stop 52: a replica's PUBLISH
    that came after a later marker's was refused unread)". Expected: her own interrupt
    cuts her turn."""

    async with _alice_working(redis_factory) as w:
        loop, client = w.loop, w.client
        await client.send(
            InboundMessage(id="b1", content="x", followup="interrupt", channel="web",
                           chat_id="a", sender_id="bob")
        )  # fmt: skip

        async def refused(n: int) -> bool:
            await loop.controls.interrupts.settled()
            return _refused(loop) >= n

        await until(lambda: refused(1), timeout_s=10)
        slow, held = await _held_publish(redis_factory)
        await slow.send(
            InboundMessage(id="a1", content="stop", followup="interrupt", channel="web",
                           chat_id="a", sender_id="alice")
        )  # fmt: skip
        assert len(held) == 1
        await client.send(
            InboundMessage(id="b2", content="y", followup="interrupt", channel="web",
                           chat_id="a", sender_id="bob")
        )  # fmt: skip
        await until(lambda: refused(2), timeout_s=10)
        await client.redis.publish(*held[0])  # her replica's PUBLISH arrives now

        async def decided() -> bool:
            await loop.controls.interrupts.settled()
            return _refused(loop) > 2 or _cut(loop) > 0

        await until(decided, timeout_s=10)
        w.model.release.set()
        got = await collect(client, "web", {"w"})
        await slow.redis.aclose()
    assert got["w"][-1].code == "cancelled", (
        f"alice's interrupt, between two of bob's read in two passes, was refused unread: "
        f"her turn ended {got['w'][-1].type}/{got['w'][-1].code}"
    )
