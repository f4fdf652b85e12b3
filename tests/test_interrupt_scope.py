"""An interrupt is carried out only for a message its session would take (tenancy, eighth
attack): behind a frontend that vouches no scope, bob's ``followup="interrupt"`` message
in alice's chat or private session is refused when it runs, and its marker, queued before
it, must not cancel her turn first. Same-scope interrupts still cancel at once. On
fakeredis and a real redis-server."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
from helpers import ScriptedProvider
from replies import collect, wait_until_async

from bus_redis import ControlMessage, FrontendClient, InboundMessage, RedisBus
from worker import AgentLoop, LoopConfig
from worker.agent.providers import LLMResponse

ALICE, BOB = {"sender_id": "alice"}, {"sender_id": "bob"}
TEAM_A = {"sender_id": "alice", "scope": "team-a"}


class Model:
    """Holds the answer to "work" until released; answers anything else at once."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.holding = asyncio.Event()

    async def __call__(self, **kw: Any) -> LLMResponse:
        last = kw["messages"][-1]
        if last["role"] == "user" and "work" in str(last["content"]):
            self.holding.set()
            await self.release.wait()
            return LLMResponse(content="work done")
        return LLMResponse(content="ok")


def _refused(loop: AgentLoop) -> float:
    value = loop.rt.metrics.registry.get_sample_value("agent_interrupts_refused_total")
    return value or 0.0


def _cut(loop: AgentLoop) -> float:
    return loop.rt.metrics.registry.get_sample_value("agent_cancel_seconds_count") or 0.0


@dataclass
class Working:
    loop: AgentLoop
    model: Model
    client: FrontendClient
    route: dict[str, Any]


@contextlib.asynccontextmanager
async def _alice_working(
    redis_factory: Any, *, private: bool = False, alice: dict[str, Any] = ALICE
) -> AsyncIterator[Working]:
    """A worker whose turn of alice's "work" (id ``w``, in chat ``web:a`` or a private
    session on ``web:a-private``) holds its model call until ``model.release``."""
    model = Model()
    loop = AgentLoop(
        RedisBus(redis_factory()),
        ScriptedProvider(handler=model),
        config=LoopConfig(read_block_ms=50),
    )
    task = asyncio.create_task(loop.run())
    client = FrontendClient(redis_factory())
    route: dict[str, Any] = {"channel": "web", "chat_id": "a"}
    try:
        if private:
            key, _ = await client.open_transient("web", "a", session_key="web:a-private")
            route |= {"session_key_override": key, "require_existing_session": True}
        await client.send(InboundMessage(id="w", content="work", **route, **alice))
        await asyncio.wait_for(model.holding.wait(), 10)
        yield Working(loop, model, client, route)
    finally:
        model.release.set()
        loop.stop()
        await asyncio.wait_for(task, 10)


async def _run_case(
    redis_factory: Any,
    *,
    private: bool,
    bob: dict[str, Any],
    alice: dict[str, Any],
    uncached: bool = False,
) -> tuple[dict[str, Any], float]:
    async with _alice_working(redis_factory, private=private, alice=alice) as w:
        loop, route = w.loop, w.route
        if uncached:  # the cache let the running session go (its bounds, a control)
            loop.rt.sessions.invalidate(route.get("session_key_override") or "web:a")
        cut = _cut(loop)
        await w.client.send(
            InboundMessage(id="b", content="stop that", followup="interrupt", **route, **bob)
        )

        async def decided() -> bool:  # refused, or carried out (the turn cut)
            return _refused(loop) > 0 or _cut(loop) > cut

        assert await wait_until_async(decided, timeout_s=10)
        w.model.release.set()
        return await collect(w.client, "web", {"w", "b"}), _refused(loop)


@pytest.mark.parametrize(
    ("private", "bob"),
    [
        pytest.param(False, BOB, id="another-sender"),
        pytest.param(True, BOB, id="another-sender-private"),
        pytest.param(False, {"sender_id": "bob", "scope": "team-b"}, id="another-vouched-scope"),
    ],
)
async def test_a_foreign_interrupt_does_not_cut_the_owners_turn(
    redis_factory, private: bool, bob: dict[str, Any]
) -> None:  # type: ignore[no-untyped-def]
    alice = TEAM_A if "scope" in bob else ALICE
    got, refused = await _run_case(redis_factory, private=private, alice=alice, bob=bob)
    assert got["w"][-1].type == "message"
    assert got["w"][-1].content == "work done"
    assert got["b"][-1].code == "invalid_message"  # and bob's own message is refused
    assert refused == 1


@pytest.mark.parametrize(
    ("private", "alice", "bob", "uncached"),
    [
        pytest.param(
            False, TEAM_A, {"sender_id": "bob", "scope": "team-a"}, False, id="same-vouched-scope"
        ),
        pytest.param(True, ALICE, ALICE, False, id="owner-private"),
        # the check compares with the running turn's session, not the cache's copy: a
        # cache that let it go (its bounds, another control) must not turn it down
        pytest.param(False, ALICE, ALICE, True, id="owner-session-left-the-cache"),
    ],
)
async def test_an_interrupt_of_the_sessions_scope_still_cuts(
    redis_factory, private: bool, alice: dict[str, Any], bob: dict[str, Any], uncached: bool
) -> None:  # type: ignore[no-untyped-def]
    got, refused = await _run_case(
        redis_factory, private=private, alice=alice, bob=bob, uncached=uncached
    )
    assert refused == 0
    assert got["w"][-1].code == "cancelled"
    assert got["b"][-1].type == "message"


async def test_a_flood_of_foreign_interrupts_is_bounded_and_others_are_served(
    redis_factory,
) -> None:  # type: ignore[no-untyped-def]
    """Bob floods alice's chat with interrupts: each is refused (checked, or refused at once
    in the passes that read them), her turn goes on, and carol's chat is answered meanwhile."""
    flood = 40
    async with _alice_working(redis_factory) as w:
        loop, client = w.loop, w.client
        bob = {"channel": "web", "chat_id": "a", "sender_id": "bob", "followup": "interrupt"}
        sends = [
            client.send(InboundMessage(id=f"b{i}", content="stop", **bob)) for i in range(flood)
        ]
        await asyncio.gather(*sends)

        async def all_refused() -> bool:
            return _refused(loop) >= flood

        assert await wait_until_async(all_refused, timeout_s=10)
        carol = await client.ask(
            InboundMessage(id="c", channel="web", chat_id="z", sender_id="carol", content="hi"),
            timeout_s=10,
        )
        assert carol.content == "ok"
        assert loop.controls.interrupts.waiting() == 0  # nothing held for the flood
        w.model.release.set()
        got = await collect(client, "web", {"w", *(f"b{i}" for i in range(flood))})
    assert got["w"][-1].content == "work done"
    assert _refused(loop) == flood
    assert {got[f"b{i}"][-1].code for i in range(flood)} == {"invalid_message"}


async def test_interrupts_heard_for_one_turn_hold_one_entry(redis_factory) -> None:  # type: ignore[no-untyped-def]
    """Twenty interrupts for one running turn heard at once: one entry waits for them (the
    earliest marker, and how many), read in one bounded step; none cuts the turn, since no
    message follows their markers, and all twenty are counted refused."""
    async with _alice_working(redis_factory) as w:
        loop = w.loop
        [(_, entry_id)] = loop.rt.turns.running().values()
        ms = int(entry_id.split("-")[0]) + 1
        for i in range(20):  # (no await between: all heard before any read)
            loop.on_control(ControlMessage(op="interrupt", session_key="web:a", marker=f"{ms}-{i}"))
        assert loop.controls.interrupts.waiting() == 20
        assert len(loop.controls.interrupts._waiting) == 1  # one entry, however many
        assert _refused(loop) == 0
        await loop.controls.interrupts.settled()
        assert _refused(loop) == 20
        w.model.release.set()
        got = await collect(w.client, "web", {"w"})
    assert got["w"][-1].content == "work done"


def _payload(msg: InboundMessage) -> str:
    return json.dumps(msg.model_dump(mode="json", exclude_none=True))


@pytest.mark.parametrize("bobs", [0, 8, 20])
async def test_a_flood_of_foreign_interrupts_does_not_use_up_the_owners(
    redis_factory, bobs: int
) -> None:  # type: ignore[no-untyped-def]
    """(A hostile reading.) Bob's interrupts, all heard before any read, then alice's:
    a table of eight waiting checks a turn, full of bob's, refused hers unread and her
    turn ran on. Now one bounded read from the earliest marker finds hers."""
    async with _alice_working(redis_factory) as w:
        loop, route = w.loop, w.route
        stream, raw = loop.rt.bus.keys.inbound("web:a"), loop.rt.bus.raw
        heard: list[str] = []
        senders = [("bob", f"b{i}") for i in range(bobs)] + [("alice", "a1")]
        for sender, mid in senders:  # as FrontendClient._interrupt writes them
            msg = InboundMessage(
                id=mid, content="stop that", followup="interrupt", **route, sender_id=sender
            )
            marker = await raw.xadd(stream, {"control": "interrupt"})
            await raw.xadd(stream, {"payload": _payload(msg)})
            heard.append(marker.decode() if isinstance(marker, bytes) else marker)
        for marker in heard:  # the pub/sub controls of a burst, heard before any read
            loop.on_control(ControlMessage(op="interrupt", session_key="web:a", marker=marker))
        await loop.controls.interrupts.settled()
        w.model.release.set()
        got = await collect(w.client, "web", {"w"})
    assert got["w"][-1].code == "cancelled"  # alice's interrupt cut her own turn
    assert _refused(loop) == 0


@dataclass
class Held:
    loop: AgentLoop
    model: Model
    client: FrontendClient
    loading: asyncio.Event  # a turn is loading its session (held until ``go``)
    go: asyncio.Event


@contextlib.asynccontextmanager
async def worker_with_held_load(redis_factory: Any) -> AsyncIterator[Held]:
    """A worker whose turns hold their session's load until ``go`` is set (once set, every
    later load goes through), and whose model holds "work" until ``model.release``."""
    model = Model()
    loop = AgentLoop(
        RedisBus(redis_factory()),
        ScriptedProvider(handler=model),
        config=LoopConfig(read_block_ms=50),
    )
    loading, go = asyncio.Event(), asyncio.Event()
    real_load = loop.rt.sessions.load_for_turn

    async def held_load(*a: Any, **kw: Any) -> Any:
        loading.set()
        await go.wait()
        return await real_load(*a, **kw)

    loop.rt.sessions.load_for_turn = held_load  # type: ignore[method-assign]
    task = asyncio.create_task(loop.run())
    client = FrontendClient(redis_factory())
    try:
        yield Held(loop, model, client, loading, go)
    finally:
        go.set()
        model.release.set()
        loop.stop()
        await asyncio.wait_for(task, 10)


async def test_the_owners_interrupt_heard_while_her_turn_loads_cuts_it(redis_factory) -> None:  # type: ignore[no-untyped-def]
    """(A hostile reading.) Alice's interrupt heard while her turn still loads its session
    on a worker that has not cached it (a fresh chat, a turn that moved): its scope was not
    known yet, so the interrupt was refused and her turn ran to its end. It waits for the
    load now."""
    route: dict[str, Any] = {"channel": "web", "chat_id": "a", "sender_id": "alice"}
    async with worker_with_held_load(redis_factory) as h:
        loop, client = h.loop, h.client
        await client.send(InboundMessage(id="w", content="work", **route))
        await asyncio.wait_for(h.loading.wait(), 10)  # her turn runs, loading its session
        await client.send(InboundMessage(id="a1", content="stop", followup="interrupt", **route))

        async def waits() -> bool:  # heard, read, and waiting for the session's scope
            await loop.controls.interrupts.settled()
            return loop.controls.interrupts.waiting() == 1

        assert await wait_until_async(waits, timeout_s=10)
        h.go.set()
        got = await collect(client, "web", {"w", "a1"})
    assert _refused(loop) == 0  # alice's own interrupt, of her own scope
    assert got["w"][-1].code == "cancelled"
    assert got["a1"][-1].type == "message"
