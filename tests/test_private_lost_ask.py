"""``FrontendClient.ask`` on a private session whose worker dies after answering, before
the asker read the answer: the loss deletes the session's events (its text must not
outlive it) but its error answers, so the answer the asker was about to read is gone.
``ask`` must return the ``session_lost`` notice then, not wait out its timeout for a
terminal event that no longer exists. Real worker processes (kill -9)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import redis.asyncio as aioredis
from replies import collect, until

from bus_redis import FrontendClient, InboundMessage, Keys

pytestmark = [pytest.mark.real_redis, pytest.mark.slow]
FAST = {"AGENT_LOCK_TTL_MS": "1000", "AGENT_OWNER_TTL_MS": "1500", "AGENT_CHANNELS": "web"}


async def _events(redis: aioredis.Redis, key: str) -> list[dict[str, Any]]:
    return [json.loads(f["payload"]) for _, f in await redis.xrange(Keys().out(key))]


async def test_ask_returns_the_loss_when_the_answer_it_was_reading_went_with_it(
    real_redis, spawn_workers
) -> None:  # type: ignore[no-untyped-def]
    [owner] = spawn_workers(1, env=FAST)
    client = FrontendClient(real_redis)
    key, opened = await client.open_transient("web", "l", session_key="web:l-private")
    await collect(client, "web", {opened}, timeout_s=20)
    spawn_workers(1, env=FAST)  # the survivor that reports the loss

    async def answered() -> bool:
        return any(
            e.get("reply_to") == "q" and e["type"] == "message"
            for e in await _events(real_redis, key)
        )

    async def reported() -> bool:
        return any(e.get("code") == "session_lost" for e in await _events(real_redis, key))

    async def slow_reader(_event: Any) -> None:  # the asker falls behind right here
        await until(answered, timeout_s=20)
        owner.kill()
        await until(reported, timeout_s=20)

    text = 'toolcall:message{"content": "working on it"} now'
    msg = InboundMessage(
        id="q", channel="web", sender_id="u", chat_id="l", content=text,
        session_key_override=key, require_existing_session=True,
    )  # fmt: skip
    got = await client.ask(msg, timeout_s=15, on_event=slow_reader)
    assert (got.type, got.code) == ("error", "session_lost")
