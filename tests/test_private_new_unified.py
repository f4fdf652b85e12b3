"""Open bug (found by a second reader of ee468b9, stop 37; not fixed yet): in unified mode
a `new` published on a private chat's key after its private session ended (closed when
idle, its worker shut down, or its holder killed between dropping the owner record and
consuming the marker) is reached under `unified:default` and folds and clears the shared
conversation of every chat, where README says a `new` of a private session is a discard.
Fix direction: decide, when the marker is published or reached, that it was a private
session's (e.g. a tombstone where the owner record was), and never widen it to the unified
key then. Strict xfail: it fails the suite the day the bug is fixed, so the mark goes."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import ScriptedProvider
from replies import collect, until, wait_until_async

from bus_redis import FrontendClient, InboundMessage, Keys
from worker.agent.providers import LLMResponse


def _m(chat: str, text: str, **kw: Any) -> InboundMessage:
    return InboundMessage(channel="web", sender_id="u", chat_id=chat, content=text, **kw)


@pytest.mark.xfail(
    strict=True, reason="open bug: a private chat's late `new` folds the unified session"
)
async def test_a_new_of_a_private_chat_closed_when_idle_never_clears_the_shared_session(  # type: ignore[no-untyped-def]
    redis_factory, make_loop
) -> None:
    """Unified mode, no crash. A private session is closed by its worker (idle, or the
    worker shut down: abandon_owner); the CLI still names the private key and its /new
    publishes `new` on it ('[private session ... discarded]'). With no owner record the
    stream folds under unified:default, whose holder (ee468b9) folds and clears the
    shared durable conversation of every chat."""

    async def answer(**kw: Any) -> LLMResponse:
        if "Summarise" in str(kw["messages"][0]["content"]):
            return LLMResponse(content='{"memory": "", "history": "h"}')
        return LLMResponse(content="ok")

    loop = make_loop(ScriptedProvider(handler=answer), unified_session=True)
    redis = redis_factory()
    client = FrontendClient(redis)
    keys, s, u = Keys(), "web:p", "unified:default"
    a = await client.send(_m("a", "my name is Ada"))
    await collect(client, "web", {a})
    _, opened = await client.open_transient("web", "p", session_key=s)
    await collect(client, "web", {opened})
    await loop.maintenance.close_private(s, "the private session was closed after being idle")
    await until(lambda: not loop.holders)  # idle: nobody holds S's own lease any more
    await client.new(s)  # the CLI's /new in the (closed) private session

    async def reached() -> bool:  # the marker was carried out and consumed
        return not await redis.xlen(keys.inbound(s))

    assert await wait_until_async(reached, timeout_s=10)
    later = await client.send(_m("a", "still there?"))
    await collect(client, "web", {later})
    stored = str(await redis.hvals(keys.session(u)))
    assert "my name is Ada" in stored, "a private chat's new cleared the shared conversation"
