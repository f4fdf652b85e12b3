"""A hostile second reading of stop 50's interrupt scope check
(``worker/runtime/interrupts.py``), by a helper in stop 51: the read counted entries, so
one foreign interrupt and plain messages hid the owner's; a cached copy of an earlier
conversation on the key decided the scope before the load; an interrupt waiting for a
load that never came stayed in the table. All three fail without stop 51's fixes. On
fakeredis and a real redis-server."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from replies import collect, until, wait_until_async
from test_interrupt_scope import _cut, _refused
from test_interrupt_scope import worker_with_held_load as _worker_with_held_load

from bus_redis import InboundMessage
from worker import AgentLoop

ROUTE: dict[str, Any] = {"channel": "web", "chat_id": "a"}


async def _heard(loop: AgentLoop, n: int) -> bool:
    await loop.controls.interrupts.settled()
    return loop.controls.interrupts.waiting() == n


@pytest.mark.parametrize("plain", [10, 70])
async def test_one_foreign_interrupt_padded_with_plain_messages_uses_up_the_owners(
    redis_factory, plain: int
) -> None:  # type: ignore[no-untyped-def]
    """SECURITY.md: "Another scope's flood of interrupts cannot use up the owner's"; the
    ARCHITECTURE table: only "an owner's interrupt behind more than 32 foreign ones" acts
    as ``queue``. But the 64-entry window counts entries, not interrupts: bob sends ONE
    interrupt, then 70 plain (queued) messages, each refused later but each an entry.
    Heard while alice's turn loads (so both wait in one merged entry, read from bob's
    earlier marker), alice's own interrupt is never reached: her turn is not cut."""
    async with _worker_with_held_load(redis_factory) as h:
        loop, client = h.loop, h.client
        await client.send(InboundMessage(id="w", content="work", **ROUTE, sender_id="alice"))
        await asyncio.wait_for(h.loading.wait(), 10)  # her turn loads its session
        await client.send(
            InboundMessage(id="b", content="x", followup="interrupt", **ROUTE, sender_id="bob")
        )
        assert await wait_until_async(lambda: _heard(loop, 1), timeout_s=10)
        for i in range(plain):  # plain messages: no interrupt among them (10: a control)
            await client.send(
                InboundMessage(id=f"p{i}", content="x", followup="queue", **ROUTE, sender_id="bob")
            )
        await client.send(
            InboundMessage(
                id="a1", content="stop", followup="interrupt", **ROUTE, sender_id="alice"
            )
        )
        assert await wait_until_async(lambda: _heard(loop, 2), timeout_s=10)
        h.go.set()

        async def decided() -> bool:
            return _refused(loop) > 0 or _cut(loop) > 0

        assert await wait_until_async(decided, timeout_s=10)
        h.model.release.set()
        got = await collect(client, "web", {"w"})
    assert got["w"][-1].code == "cancelled"  # alice's own interrupt cut her turn


async def test_the_cached_copy_of_an_earlier_conversation_lets_its_owner_cut_a_new_ones_turn(
    redis_factory,
) -> None:  # type: ignore[no-untyped-def]
    """Before the running turn has loaded its session, the check takes the scope of the
    worker's cached copy, whatever its generation. Alice's chat was pruned as idle by
    another worker (maintenance invalidates only its own cache); bob starts a new
    conversation on the key, which is his; while his first turn loads, alice's interrupt
    is judged against her stale copy and cuts bob's turn (and her message is then refused
    in bob's conversation): the foreign interrupt the check exists to refuse."""
    async with _worker_with_held_load(redis_factory) as h:
        loop, client = h.loop, h.client
        h.go.set()  # alice's first conversation loads freely
        h.model.release.set()
        await client.send(InboundMessage(id="w0", content="hello", **ROUTE, sender_id="alice"))
        await collect(client, "web", {"w0"})
        assert loop.rt.sessions.get_cached("web:a") is not None  # cached here, scope alice
        store = loop.rt.sessions.store

        async def pruned() -> bool:  # as another worker's maintenance does (idle: 1 ms)
            return "web:a" in await store.prune_idle("web", 1, limit=10)

        await until(pruned)
        cached = loop.rt.sessions.get_cached("web:a")
        assert cached is not None  # this worker kept its copy
        assert cached.scope
        h.go.clear()
        h.loading.clear()
        h.model.release.clear()
        await client.send(InboundMessage(id="w", content="work", **ROUTE, sender_id="bob"))
        await asyncio.wait_for(h.loading.wait(), 10)  # bob's first turn loads the new one
        await client.send(
            InboundMessage(
                id="a1", content="stop", followup="interrupt", **ROUTE, sender_id="alice"
            )
        )

        async def decided() -> bool:
            await loop.controls.interrupts.settled()
            return _refused(loop) > 0 or _cut(loop) > 0 or loop.controls.interrupts.waiting() > 0

        assert await wait_until_async(decided, timeout_s=10)
        h.go.set()

        async def final() -> bool:
            return _refused(loop) > 0 or _cut(loop) > 0

        assert await wait_until_async(final, timeout_s=10)
        h.model.release.set()
        got = await collect(client, "web", {"w", "a1"})
    assert got["a1"][-1].code == "invalid_message"  # web:a is bob's conversation now
    assert got["w"][-1].content == "work done"  # ... so alice's interrupt must not cut it


async def test_an_interrupt_heard_while_a_turn_loads_is_decided_when_the_turn_fails_there(
    redis_factory,
) -> None:  # type: ignore[no-untyped-def]
    """``_prune_loading``: "so the table holds running turns only". Bob's message runs in
    alice's chat (the worker has no copy cached); bob's interrupt is heard while it loads
    and waits for the scope. The turn ends at the scope check, before ``set_scope``, and
    so does the turn of bob's interrupting message: nothing prunes the waiting entry,
    which is held for a turn that ended (never counted refused) until some other
    interrupt reaches this worker."""
    async with _worker_with_held_load(redis_factory) as h:
        loop, client = h.loop, h.client
        h.go.set()
        h.model.release.set()
        await client.send(InboundMessage(id="w0", content="hello", **ROUTE, sender_id="alice"))
        await collect(client, "web", {"w0"})
        loop.rt.sessions.invalidate("web:a")  # (a moved session: not cached here)
        h.go.clear()
        h.loading.clear()
        await client.send(InboundMessage(id="x", content="x", **ROUTE, sender_id="bob"))
        await asyncio.wait_for(h.loading.wait(), 10)
        await client.send(
            InboundMessage(id="b", content="x", followup="interrupt", **ROUTE, sender_id="bob")
        )
        assert await wait_until_async(lambda: _heard(loop, 1), timeout_s=10)
        h.go.set()
        got = await collect(client, "web", {"x", "b"})
        assert got["x"][-1].code == "invalid_message"
        assert got["b"][-1].code == "invalid_message"
        await until(lambda: not loop.rt.turns.running())  # both turns are over
        await loop.controls.interrupts.settled()
        assert loop.controls.interrupts.waiting() == 0  # nothing held for an ended turn
        assert _refused(loop) == 1  # bob's interrupt was refused, and counted
