"""A hostile review of what one channel's flood costs the others: the worker's memory
of aborting controls (one table for every channel) and a private session's owner's
inbox (one entry per forwarded note, for ever). Each test failed on 88bf850."""

from __future__ import annotations

from typing import Any

from helpers import ScriptedProvider
from replies import until

from bus_redis import Keys
from worker.agent.providers import LLMResponse

K = Keys()


async def _echo(**kw: Any) -> LLMResponse:
    return LLMResponse(content="ok")


async def _drained(redis: Any, stream: str) -> bool:
    return await redis.xlen(stream) == 0


async def test_forwards_to_a_private_sessions_owner_are_bounded(
    redis_factory, make_loop, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """A notification for a private session owned by another worker is forwarded to that
    worker's inbox (``P:worker:<id>:inbox``), once per notification. A frontend may write
    its ready queue as often as it likes, so one channel made the owner's inbox grow by
    one entry per note it wrote, in a key no channel owns and nothing trimmed. The inbox
    is capped (``INBOX_MAXLEN``, 50 here); a forward trimmed away is made good by the
    owner's check of its sessions every maintenance tick."""
    monkeypatch.setattr("bus_redis.queue.INBOX_MAXLEN", 50)
    redis = redis_factory()
    owner, private = "w-owner", "web:priv"
    await redis.hset(K.owner(private), "worker", owner)  # as acquire.lua writes it
    await redis.pexpire(K.owner(private), 600_000)
    make_loop(ScriptedProvider(handler=_echo), worker_id="w-other")
    n = 300
    async with redis_factory().pipeline(transaction=False) as pipe:  # the frontend's XADDs
        for _ in range(n):
            pipe.xadd(K.ready("web"), {"session": private})
        await pipe.execute()
    await until(lambda: _drained(redis, K.ready("web")), timeout_s=30)
    forwarded = await redis.xlen(K.inbox(owner))
    assert 0 < forwarded <= 50, f"{forwarded} forwards in the owner's inbox for {n} notes"


def test_a_control_flood_of_one_channel_forgets_no_other_channels_subagent_abort() -> None:
    """``Subagents.stopped`` (the aborting controls a worker heard, so that a subagent job
    of that session starting or finishing here afterwards drops itself instead of
    publishing) was one LRU of 10,000 sessions for every channel: one channel's flood of
    controls for made-up sessions pushed another channel's stop out, and that user's
    subagent published its result into the conversation they stopped. Each channel now
    has its own (as ``TurnRegistry.note_control`` has)."""
    from bus_redis import ControlMessage
    from worker.jobs.subagent_aborts import SPAWNED_HERE_MAX, Aborts

    sub = Aborts(None, None, {}, set())  # type: ignore[arg-type]  # (only its tables)
    sub.on_control(ControlMessage(op="stop", session_key="telegram:t", marker="5-0"))
    spec = {"session": "telegram:t", "after": "1-0"}  # spawned by an entry before the stop
    assert sub.stopped_after(spec)
    for i in range(SPAWNED_HERE_MAX + 1):  # one frontend's controls for made-up sessions
        sub.on_control(ControlMessage(op="stop", session_key=f"web:f{i}", marker="9-0"))
    assert sum(map(len, sub.stopped.values())) <= 2 * SPAWNED_HERE_MAX  # bounded
    assert sub.stopped_after(spec), "web's control flood made this worker forget telegram's stop"
