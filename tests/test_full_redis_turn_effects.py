"""A full Redis (maxmemory reached, noeviction) at a turn's effects other than its commit,
as a hostile reviewer attacked them: the fold of a ``new`` and a tool round's journal.

A full Redis refuses a write before it ran (``OutOfMemoryError``): it is no fault of the
message or the marker, and the commit already waits it out under its lease (``holder.py``
``_commit_entry``). Here it is simulated by a wrapper that raises it for one script (or
bus call) a chosen number of times, then lets the writes through: Redis has room again.
That runs the same on fakeredis and on a real redis-server (``redis`` fixture), and
refuses only the write under test (a real ``maxmemory`` would refuse the lease's renewals
and the failure notes too, which other tests cover).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
from helpers import ScriptedProvider
from redis.exceptions import OutOfMemoryError
from replies import collect, until

from bus_redis import FrontendClient, InboundMessage, Keys
from worker.agent.providers import LLMResponse, ToolCallRequest

K = Keys()
OOM = "command not allowed when used memory > 'maxmemory'."


def _msg(chat: str, text: str, mid: str) -> InboundMessage:
    return InboundMessage(
        id=mid, channel="web", sender_id="u", chat_id=chat, content=text, scope="team"
    )


class Full:
    """Stands in for an async call: its first ``times`` calls that ``when`` picks are
    refused as a full Redis refuses a write (before it ran); every call after goes
    through. ``seen`` keeps what ``on_refused`` returned at each refusal."""

    def __init__(
        self,
        target: Callable[..., Awaitable[Any]],
        times: int,
        *,
        when: Callable[..., bool] = lambda *a, **kw: True,
        on_refused: Callable[..., Awaitable[Any]] | None = None,
    ) -> None:
        self.target, self.left, self.when, self.on_refused = target, times, when, on_refused
        self.refused = 0
        self.seen: list[Any] = []

    async def __call__(self, *args: Any, **kw: Any) -> Any:
        if self.left > 0 and self.when(*args, **kw):
            self.left -= 1
            self.refused += 1
            if self.on_refused is not None:
                self.seen.append(await self.on_refused(*args, **kw))
            raise OutOfMemoryError(OOM)
        return await self.target(*args, **kw)


def _remembering(prompts: list[list[dict[str, Any]]]) -> ScriptedProvider:
    """Answers "ok"; a summary request (a ``new``'s fold) with a memory that quotes
    nothing of the conversation. Keeps the messages of every turn's model call."""

    async def answer(**kw: Any) -> LLMResponse:
        messages = kw["messages"]
        if "Summarise" in str(messages[0]["content"]):
            return LLMResponse(content='{"memory": "a user", "history": "a chat"}')
        prompts.append(messages)
        return LLMResponse(content="ok")

    return ScriptedProvider(handler=answer)


# --- (a) a full Redis at the fold of a `new` ----------------------------------------------


async def test_a_full_redis_at_the_fold_of_a_new_leaves_no_lease_behind_unrenewed(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """``new`` folds the old conversation under the session's lease
    (``fold_into_memory``: ``rt.bus.consolidate``). Its OutOfMemoryError is caught
    nowhere: it leaves ``SessionHolder.discarded`` and ``drain`` (whose ``finally`` only
    stops the renewals) and ``_serve`` logs "serving ... failed". The lease is neither
    released nor renewed: it stays in Redis, held by a holder that is gone, and the
    session (its `new`, and every message queued behind it) waits a whole lease TTL for
    the lease sweep, instead of the worker waiting out the full Redis while it holds the
    lease (as a commit does) or handing the session over at once."""
    prompts: list[list[dict[str, Any]]] = []
    loop = make_loop(_remembering(prompts))  # the default lease TTL (10 s)
    client = FrontendClient(redis)
    key = "web:fold"
    assert (await client.ask(_msg("fold", "my name is Ada", "m1"), timeout_s=10)).content == "ok"
    full = Full(loop.bus.consolidate, 1)  # one refusal: Redis has room again at once
    loop.bus.consolidate = full
    await client.new(key)
    await until(lambda: full.refused == 1, timeout_s=10)
    # the worker is done with the session: it waited the full Redis out and let go, or
    # handed it over; either way no holder of it is left here ...
    await until(lambda: key not in loop.holders, timeout_s=10)
    # ... so nothing may be left holding its lease
    held = await redis.get(K.lease(key))
    ttl_ms = await redis.pttl(K.lease(key))
    assert held is None, (
        f"the lease of {key} is left held ({held!r}, {ttl_ms} ms left) by a holder that is "
        "gone: nobody renews or releases it, the session stalls until it runs out"
    )
    # and the `new` took effect: the next turn does not see the old conversation
    assert (await client.ask(_msg("fold", "who am I?", "m2"), timeout_s=10)).content == "ok"
    assert [m["content"] for m in prompts[-1][1:]] == ["who am I?"]


async def test_a_new_whose_fold_meets_a_full_redis_takes_effect_once_redis_has_room(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """Each reach of the `new` marker whose fold is refused for memory counts an attempt
    of the marker (next.lua's HINCRBY) and stalls the session a lease TTL (see above).
    After AGENT_MAX_DELIVERIES such spells the marker is dropped ("reached N times without
    taking effect") and the old conversation goes on: the user asked for a fresh one and
    the next answer is made from the old history. A full Redis is not the marker's fault:
    once Redis has room the `new` must take effect."""
    prompts: list[list[dict[str, Any]]] = []
    # a short lease, so that on the code that stalls a spell lasts about a second
    loop = make_loop(_remembering(prompts), max_deliveries=2, lock_ttl_ms=1000)
    client = FrontendClient(redis)
    key = "web:spells"
    assert (await client.ask(_msg("spells", "my name is Ada", "m1"), timeout_s=10)).content == "ok"
    attempts_key = K.attempts(key)

    async def marker_attempts(*_a: Any, **_kw: Any) -> list[str]:
        return sorted((await redis.hgetall(attempts_key)).values())

    # refused as often as a marker may be reached: a full Redis for that many spells
    full = Full(loop.bus.consolidate, 2, on_refused=marker_attempts)
    loop.bus.consolidate = full
    await client.new(key)
    after = _msg("spells", "who am I?", "m2")  # queued behind the marker
    await client.send(after)
    got = await collect(client, "web", {"m2"}, timeout_s=30)
    assert [(e.type, e.content) for e in got["m2"] if e.is_terminal] == [("message", "ok")]
    assert full.refused == 2
    old = [m["content"] for m in prompts[-1][1:]]
    assert old == ["who am I?"], (
        f"the `new` was dropped after {full.refused} refusals for memory (the marker's "
        f"attempts counted at each: {full.seen}); the next turn saw the old conversation: "
        f"{old}"
    )
    assert await redis.hget(K.session(key), "count") == "2"
    # nor did the full Redis spend the marker's attempts (it was reached once)
    assert full.seen == [["1"], ["1"]], full.seen


# --- (b) a full Redis at a tool round's journal write -------------------------------------


def _tool_round_model(asked: list[str]) -> ScriptedProvider:
    """A healthy message: the model calls ``create_goal`` once, then answers "planned"."""

    async def answer(**kw: Any) -> LLMResponse:
        last = kw["messages"][-1]
        asked.append(str(last["role"]))
        if last["role"] == "user":
            call = ToolCallRequest("c1", "create_goal", {"title": "plan the trip"})
            return LLMResponse(tool_calls=[call])
        return LLMResponse(content="planned")

    return ScriptedProvider(handler=answer)


async def test_a_full_redis_at_a_tool_rounds_journal_does_not_dead_letter_the_message(  # type: ignore[no-untyped-def]
    redis: aioredis.Redis, make_loop
) -> None:
    """A durable turn journals its tool round (``TurnJournal.record`` ->
    ``JournalStore.append`` -> journal.lua) before any call runs. Refused for memory, the
    OutOfMemoryError goes up through the runner to the generic ``except Exception`` of
    ``EntryPolicy._outcome_spec``: a failure is noted, the entry is read again and a
    delivery is counted, as for a message that broke the turn. A full Redis at that write
    AGENT_MAX_DELIVERIES times dead-letters a healthy message. A full Redis is not the
    message's fault: the worker waits it out while it holds the lease (as ``_commit_entry``
    does for the commit), answers the message once Redis has room, never dead-letters it,
    and spends none of its deliveries on it."""
    asked: list[str] = []
    loop = make_loop(_tool_round_model(asked), max_deliveries=2)
    client = FrontendClient(redis)
    key = "web:plan"
    attempts_key = K.attempts(key)

    def appends(name: str, keys: list[str], args: list[Any], **_kw: Any) -> bool:
        return name == "journal" and len(args) > 3  # rows to append (not a drop)

    async def deliveries(name: str, keys: list[str], args: list[Any], **_kw: Any) -> str | None:
        entry_id = str(args[1]).rpartition("|")[2]
        return await redis.hget(attempts_key, entry_id)

    # refused as often as a message may be delivered: a full Redis for that many moments
    full = Full(loop.bus.scripts.call, 2, when=appends, on_refused=deliveries)
    loop.bus.scripts.call = full
    await client.send(_msg("plan", "plan my trip", "m1"))
    got = await collect(client, "web", {"m1"}, timeout_s=30)
    terminal = [(e.type, e.code, e.content) for e in got["m1"] if e.is_terminal]
    assert full.refused == 2
    assert terminal == [("message", None, "planned")], (
        f"a healthy message whose tool round met a full Redis {full.refused} times was "
        f"answered {terminal}"
    )
    assert await redis.xlen(K.dead("web")) == 0
    assert full.seen == ["1", "1"], (
        f"deliveries counted at each refusal for memory: {full.seen} (a full Redis spent them)"
    )
