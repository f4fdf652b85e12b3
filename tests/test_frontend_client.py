"""FrontendClient without a worker, on fakeredis and a real redis-server, on whatever
redis-py the venv has (5 beside the worker, 8 in the frontend venv): a wait that times out
ends. (redis-py 8 can swallow the cancellation of a command in flight; the event hub's
test of subscribers leaving mid-setup shows it, this one guards the client's own loop.)"""

from __future__ import annotations

import asyncio

import pytest

from bus_redis import FrontendClient, InboundMessage

pytestmark = pytest.mark.frontend


async def test_an_unanswered_ask_times_out_instead_of_hanging(redis_factory) -> None:  # type: ignore[no-untyped-def]
    client = FrontendClient(redis_factory())
    for timeout_s in (0.05, 0.2, 0.5):  # different points of the blocking reads
        msg = InboundMessage(channel="nobody", sender_id="u", chat_id="c", content="hello?")
        task = asyncio.create_task(client.ask(msg, timeout_s=timeout_s))
        done, _ = await asyncio.wait({task}, timeout=10)
        assert task in done, f"ask(timeout_s={timeout_s}) still waiting after 10 s"
        assert isinstance(task.exception(), TimeoutError)


async def test_a_control_is_published_naming_its_marker(redis_factory) -> None:  # type: ignore[no-untyped-def]
    """The pub/sub message carries the id of the marker it added, so a worker running an
    entry before it can cancel without reading the stream (README: Stop, discard)."""
    import json

    from bus_redis import Keys

    client, keys = FrontendClient(redis_factory()), Keys()
    pubsub = redis_factory().pubsub()
    await pubsub.subscribe(keys.control("web"))
    await client.send(InboundMessage(channel="web", sender_id="u", chat_id="m", content="hi"))
    assert await client.stop("web:m") == 1
    for _ in range(10):  # the subscription's confirmation first, then the control
        msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=5)
        if msg is not None:
            break
    doc = json.loads(msg["data"])
    ((last_id, fields),) = await client.redis.xrevrange(keys.inbound("web:m"), count=1)
    assert fields == {"control": "stop"}
    assert doc == {"v": 2, "op": "stop", "session_key": "web:m", "marker": last_id}
    await pubsub.aclose()
