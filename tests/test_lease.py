"""Lease renewal: one task per bus renews the leases held (worker/runtime/lease.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as aioredis
from replies import until

from bus_redis import Keys, RedisBus
from bus_redis.results import Acquired
from worker.ops.metrics import WorkerMetrics
from worker.runtime.lease import Lease

# renewals every third of it: 1 s leaves a renewal 600 ms of a loaded box's stalls (the
# suite runs in three processes beside real workers; at 300 ms one CI run lost a lease)
TTL_MS = 1000


async def _held(bus: RedisBus, key: str) -> Lease:
    got = await bus.acquire(key, "w1", select=False)  # held, nothing selected
    assert isinstance(got, Acquired)
    return Lease(bus, key, got.token, on_lost=lambda: None)


async def test_a_held_lease_outlives_its_ttl_until_stopped(redis: aioredis.Redis) -> None:
    bus = RedisBus(redis, lock_ttl_ms=TTL_MS)
    lost: list[str] = []
    leases = [await _held(bus, f"web:l{i}") for i in range(3)]
    for lease in leases:
        lease._on_lost = lambda key=lease.key: lost.append(key)  # type: ignore[misc]
        lease.start()
    loop = asyncio.get_running_loop()
    end = loop.time() + 4 * TTL_MS / 1000
    while loop.time() < end:  # four TTLs: only renewals keep the leases
        for lease in leases:
            assert await redis.get(Keys().lease(lease.key)) == lease.token
        await asyncio.sleep(0.02)
    await leases[0].stop()

    async def gone() -> bool:
        return not await redis.exists(Keys().lease("web:l0"))

    await until(gone, timeout_s=5)  # stopped: it runs out
    assert await redis.get(Keys().lease("web:l1")) == leases[1].token  # the others renewed
    assert lost == []
    for lease in leases[1:]:
        await lease.stop()
    await bus.aclose()


async def test_a_lease_another_took_is_lost_at_its_next_renewal(redis: aioredis.Redis) -> None:
    bus = RedisBus(redis, lock_ttl_ms=TTL_MS)
    lease = await _held(bus, "web:taken")
    lost: list[bool] = []
    lease._on_lost = lambda: lost.append(True)  # type: ignore[method-assign]
    lease.start()
    await redis.set(Keys().lease("web:taken"), "other|w2", px=10_000)
    await until(lambda: bool(lost), timeout_s=5)
    assert lease.lost
    assert await redis.get(Keys().lease("web:taken")) == "other|w2"
    await lease.stop()
    await bus.aclose()


async def test_a_stopped_lease_is_never_declared_lost(redis: aioredis.Redis) -> None:
    """A renewal answered after stop() (the lease released, even taken by another) is
    ignored: it must not cancel a newer turn of the same key on this worker."""
    bus = RedisBus(redis, lock_ttl_ms=TTL_MS)
    lease = await _held(bus, "web:done")
    lost: list[bool] = []
    lease._on_lost = lambda: lost.append(True)  # type: ignore[method-assign]
    lease.start()
    await lease.stop()
    await redis.set(Keys().lease("web:done"), "next|w1", px=10_000)
    await lease.renew()  # as a renewal already under way would end
    assert lost == []
    assert not lease.lost
    await bus.aclose()


async def test_a_stopped_lease_holds_no_longer_than_its_last_term(redis: aioredis.Redis) -> None:
    """``holds()`` looked at the term only while the lease was renewed: once stopped it
    held for ever, so a wait that asks it (a write tried again while Redis is full)
    reached after the stop would wait as long as Redis stayed full. Now a stopped lease
    holds until its last term ends, and is not declared lost for it."""
    import time

    bus = RedisBus(redis, lock_ttl_ms=TTL_MS)
    lease = await _held(bus, "web:term")
    lease.start()
    await lease.stop()
    assert lease.holds()  # its term runs still
    lease._deadline = time.monotonic() - 0.001  # (its term is over)
    assert not lease.holds()
    assert not lease.lost
    await bus.aclose()


async def test_a_stopped_lease_lets_go_of_its_holder(redis: aioredis.Redis) -> None:
    """The schedule names a stopped lease until its due time; the holder behind it (and
    the payload it read) is not kept that long."""
    import gc
    import weakref

    class Holder:
        def lost(self) -> None: ...

    bus = RedisBus(redis, lock_ttl_ms=10_000)
    holder = Holder()
    alive = weakref.ref(holder)
    lease = await _held(bus, "web:gc")
    lease._on_lost = holder.lost  # type: ignore[method-assign]
    lease.start()
    await lease.stop()
    del holder
    gc.collect()
    assert alive() is None
    await bus.aclose()


def test_short_ttls_are_looked_at_more_often() -> None:
    from worker.runtime.lease import Renewals

    assert Renewals(10_000).tick_s == 0.05
    assert Renewals(300).tick_s == 0.01  # a tenth of the 100 ms between renewals


async def test_a_taken_over_holder_cancels_its_own_entry_not_the_newer_turn_of_its_key() -> None:
    """A holder whose lease was taken over (its worker was paused) may still be finishing
    when the same worker takes the key again: its lease loss cancels its own entry, never
    the newer holder's turn, which holds a valid lease."""
    from types import SimpleNamespace

    from worker.runtime.holder import SessionHolder
    from worker.runtime.inflight import TurnRegistry

    turns = TurnRegistry()
    rt: Any = SimpleNamespace(
        turns=turns, bus=SimpleNamespace(lock_ttl_ms=10_000), metrics=WorkerMetrics()
    )

    def holder(entry_id: str) -> tuple[SessionHolder, asyncio.Task[None]]:
        made = SessionHolder(rt, "web:k", Acquired(f"n{entry_id}|w", 1, "g", 0, None), set())
        made.slot = turns.begin("web:k", "web:k", entry_id)
        task = asyncio.create_task(asyncio.Event().wait())  # type: ignore[arg-type]
        turns.attach(made.slot, task)
        return made, task

    stale, stale_turn = holder("1-0")
    newer, newer_turn = holder("2-0")
    stale.lease.mark_lost()
    assert newer_turn.cancelling() == 0
    assert turns.reason("web:k") is None
    assert stale_turn.cancelling() == 1
    assert stale.slot is not None
    assert stale.slot.reason == "lease_lost"
    newer.abort("shutdown")
    await asyncio.gather(newer_turn, return_exceptions=True)
    assert newer_turn.cancelled()
    assert turns.reason("web:k") == "shutdown"
    stale_turn.cancel()
    await asyncio.gather(stale_turn, return_exceptions=True)


async def test_a_lost_lease_cancels_a_turn_of_the_in_process_api(redis, make_loop) -> None:  # type: ignore[no-untyped-def]
    """``process_message``'s turn is its holder's own entry too: when its lease is taken
    over, the turn is cancelled at once (its commit would be refused), not run to its end."""
    from helpers import ScriptedProvider

    from bus_redis import InboundMessage
    from worker.agent.providers import LLMResponse
    from worker.runtime.outcomes import TurnAbortedError

    answer = asyncio.Event()

    async def held(**_kw: Any) -> LLMResponse:
        await answer.wait()
        return LLMResponse(content="done", usage={})

    provider = ScriptedProvider(handler=held)
    loop = make_loop(provider, lock_ttl_ms=300)
    msg = InboundMessage(channel="web", sender_id="u", chat_id="d1", content="hi")
    call = asyncio.create_task(loop.process_message(msg))
    await asyncio.wait_for(provider.started.wait(), 5)
    await redis.set(Keys().lease(loop.effective_key(msg.session_key)), "n|other", px=10_000)
    with pytest.raises(TurnAbortedError):
        await asyncio.wait_for(call, 5)  # not answered: the provider still holds the call
    answer.set()
