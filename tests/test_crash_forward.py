"""A worker killed (kill -9) between its acquire that found the session another worker's
private one and the forward of the notification to that owner (``loop._serve_note``: the
``after_acquire`` fault point), per-session and unified, with real processes: the owner
still answers the message, once, in the private conversation (its periodic look at its
sessions' streams, or the stranded-stream sweep, finds it)."""

from __future__ import annotations

import asyncio
import json
import signal

import pytest
from replies import collect

from bus_redis import FrontendClient, InboundMessage

pytestmark = [pytest.mark.real_redis, pytest.mark.slow]
FAST = {"AGENT_LOCK_TTL_MS": "1000", "AGENT_SWEEP_INTERVAL_MS": "500"}


@pytest.mark.parametrize("unified", [False, True])
async def test_a_forward_cut_by_a_crash_is_answered_by_the_owner_once(
    real_redis, spawn_workers, fake_llm, unified: bool
) -> None:  # type: ignore[no-untyped-def]
    env = {**FAST, "AGENT_UNIFIED_SESSION": "1"} if unified else FAST
    [owner] = spawn_workers(1, env=env)
    client = FrontendClient(real_redis)
    key, opened = await client.open_transient("web", "f", session_key="web:f-private")
    await collect(client, "web", {opened}, timeout_s=20)
    private = {"session_key_override": key, "require_existing_session": True}

    def m(mid: str, text: str) -> InboundMessage:
        return InboundMessage(
            id=mid, channel="web", sender_id="u", chat_id="f", content=text, **private
        )

    await client.ask(m("f1", "the code word is heron"), timeout_s=20)
    owner.signal(signal.SIGSTOP)  # only the doomed worker reads the next notification
    try:
        [doomed] = spawn_workers(1, env={**env, "AGENT_FAULT_POINTS": "after_acquire"})
        ask = await client.send(m("f2", "what is the code word?"))
        assert await asyncio.to_thread(doomed.proc.wait, 30) == 137  # found it forwarded
    finally:
        owner.signal(signal.SIGCONT)
    got = await collect(client, "web", {ask}, timeout_s=30)

    [answer] = [ev for ev in got[ask] if ev.is_terminal]
    assert (answer.type, answer.code) == ("message", None)
    asked = [r for r in fake_llm.requests if "what is the code word" in json.dumps(r)]
    assert len(asked) == 1
    assert "the code word is heron" in json.dumps(asked[0])  # in the private conversation
