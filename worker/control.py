"""The control subscription: pub/sub with an explicit reconnect loop.

Pub/sub is at-most-once; after every (re)subscription ``on_subscribed`` runs so the
worker can look at the control flags it may have missed while disconnected.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from pydantic import ValidationError
from redis.asyncio import Redis
from redis.exceptions import RedisError

from bus_redis import ControlMessage
from bus_redis.codec import text
from worker.backoff import Backoff

log = logging.getLogger(__name__)


class ControlListener:
    def __init__(
        self,
        redis: Redis,
        channel: str,
        on_control: Callable[[ControlMessage], None],
        on_subscribed: Callable[[], Awaitable[None]],
    ) -> None:
        self.redis = redis
        self.channel = channel
        self.on_control = on_control
        self.on_subscribed = on_subscribed
        self.subscribed = asyncio.Event()

    async def run(self) -> None:
        backoff = Backoff("control subscription", log)
        while True:
            pubsub = self.redis.pubsub()
            try:
                await pubsub.subscribe(self.channel)
                await self.on_subscribed()
                self.subscribed.set()
                backoff.reset()
                await self._listen(pubsub)
            except (RedisError, OSError) as exc:
                self.subscribed.clear()
                await backoff.after(exc)
            finally:
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()

    async def _listen(self, pubsub: object) -> None:
        while True:
            msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)  # type: ignore[attr-defined]
            if msg is None or msg.get("type") != "message":
                continue
            try:
                control = ControlMessage.model_validate_json(text(msg["data"]))
            except ValidationError:
                log.warning("ignored a malformed control message")
                continue
            self.on_control(control)
