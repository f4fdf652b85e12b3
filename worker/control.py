"""The control subscription: each channel's control channel (``P:{C}:control``) on a
connection of its own, so a channel that floods its controls delays only itself.

Channels are spread over at most ``connections`` subscriptions (sorted, round robin: with
that many channels or fewer each has its own connection). Redis delivers a connection's
messages in order, so a flood queues behind itself only; each subscription has its own
reconnect loop with backoff. A control is taken only for a session of the channel it was
published on (a frontend can publish on its own channel only). Pub/sub is at-most-once:
after every (re)subscription ``on_subscribed`` runs so the worker can look for control
markers it may have missed while it was not listening.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable

from pydantic import ValidationError
from redis.asyncio import Redis
from redis.exceptions import RedisError

from bus_redis import ControlMessage, Keys
from bus_redis.codec import safe, strict_text, text
from bus_redis.keys import in_channel
from worker.backoff import Backoff

log = logging.getLogger(__name__)
CONTROL_CONNECTIONS = 16  # subscriptions per worker at most (channels share them beyond)
YIELD_EVERY = 8  # messages read in a row before the listener lets other tasks run


class ControlListener:
    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        on_control: Callable[[ControlMessage], None],
        on_subscribed: Callable[[], Awaitable[None]],
        *,
        connections: int = CONTROL_CONNECTIONS,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.on_control = on_control
        self.on_subscribed = on_subscribed
        self.connections = max(1, connections)
        self.subscribed = asyncio.Event()  # every current subscription is listening
        self._shards: dict[frozenset[str], asyncio.Task[None]] = {}
        self._listening: set[frozenset[str]] = set()
        self._changed = asyncio.Event()
        self._wanted: list[frozenset[str]] = []

    def set_channels(self, channels: Iterable[str]) -> None:
        """The channels to listen to (called whenever the served channels change)."""
        ordered = sorted(set(channels))
        n = min(self.connections, len(ordered)) or 1
        shards = [frozenset(ordered[i::n]) for i in range(n)]
        wanted = [s for s in shards if s]
        if wanted != self._wanted:
            self._wanted = wanted
            self._changed.set()

    async def run(self) -> None:
        """Keep one subscription task per shard of channels until cancelled."""
        try:
            while True:
                self._changed.clear()
                wanted = set(self._wanted)
                for shard in list(self._shards):
                    if shard not in wanted:
                        self._shards.pop(shard).cancel()
                        self._listening.discard(shard)
                for shard in wanted - set(self._shards):
                    self._shards[shard] = asyncio.create_task(self._subscription(shard))
                self._update_subscribed()
                await self._changed.wait()
        finally:
            tasks = list(self._shards.values())
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _update_subscribed(self) -> None:
        if set(self._wanted) <= self._listening:
            self.subscribed.set()
        else:
            self.subscribed.clear()

    async def _subscription(self, shard: frozenset[str]) -> None:
        backoff = Backoff(f"control subscription ({len(shard)} channels)", log)
        names = [self.keys.control(c) for c in sorted(shard)]
        while True:
            pubsub = self.redis.pubsub()
            try:
                await pubsub.subscribe(*names)
                await self._after_subscribing()
                self._listening.add(shard)
                self._update_subscribed()
                backoff.reset()
                await self._listen(pubsub)
            except (RedisError, OSError) as exc:
                self._listening.discard(shard)
                self._update_subscribed()
                await backoff.after(exc)
            except Exception as exc:  # never let a subscription end: controls must work
                log.exception("control subscription failed")
                self._listening.discard(shard)
                self._update_subscribed()
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
        taken = 0
        while True:
            taken += 1
            if taken % YIELD_EVERY == 0:  # a flood in the socket buffer never holds the
                await asyncio.sleep(0)  # event loop: turns, commits, other channels go on
            msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)  # type: ignore[attr-defined]
            if msg is None or msg.get("type") != "message":
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
