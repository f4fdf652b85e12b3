"""The control subscription: pattern pub/sub over every channel's control channel
(``P:{C}:control``), with an explicit reconnect loop.

A control is taken only for a session of the channel it was published on (a frontend
can publish on its own channel only). Pub/sub is at-most-once; after every
(re)subscription ``on_subscribed`` runs so the worker can look for control markers it
may have missed while disconnected.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from pydantic import ValidationError
from redis.asyncio import Redis
from redis.exceptions import RedisError

from bus_redis import ControlMessage, Keys
from bus_redis.codec import safe, strict_text, text
from bus_redis.keys import in_channel
from worker.backoff import Backoff

log = logging.getLogger(__name__)


class ControlListener:
    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        on_control: Callable[[ControlMessage], None],
        on_subscribed: Callable[[], Awaitable[None]],
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.on_control = on_control
        self.on_subscribed = on_subscribed
        self.subscribed = asyncio.Event()

    async def run(self) -> None:
        backoff = Backoff("control subscription", log)
        while True:
            pubsub = self.redis.pubsub()
            try:
                await pubsub.psubscribe(self.keys.control_pattern)
                await self._after_subscribing()
                self.subscribed.set()
                backoff.reset()
                await self._listen(pubsub)
            except (RedisError, OSError) as exc:
                self.subscribed.clear()
                await backoff.after(exc)
            except Exception as exc:  # never let the subscription end: controls must work
                log.exception("control subscription failed")
                self.subscribed.clear()
                await backoff.after(exc)
            finally:
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()

    async def _after_subscribing(self) -> None:
        try:
            await self.on_subscribed()
        except (RedisError, OSError):
            raise
        except Exception:  # a bug there must not stop the subscription (nor the worker)
            log.exception("checking for missed controls failed")

    async def _listen(self, pubsub: object) -> None:
        while True:
            msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)  # type: ignore[attr-defined]
            if msg is None or msg.get("type") != "pmessage":
                continue
            channel = self.keys.channel_of_control(text(msg["channel"]))
            data = strict_text(msg["data"])
            try:
                if data is None:
                    raise ValueError("not UTF-8")
                control = ControlMessage.model_validate_json(data)
            except (ValidationError, ValueError):
                log.warning("ignored a malformed control message on %s", safe(msg["channel"]))
                continue
            if channel is None or not in_channel(control.session_key, channel):
                log.warning("ignored a control for another channel on %s", safe(msg["channel"]))
                continue
            try:
                self.on_control(control)
            except Exception:  # one bad control must not end the subscription
                log.exception("handling a control for %s failed", safe(control.session_key))
