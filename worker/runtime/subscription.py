"""The control subscription: each channel's control channel (``P:{C}:control``) on a
connection of its own, so a channel that floods its controls delays only itself.

Channels are placed on at most ``connections`` subscriptions: a new channel goes to the
one with the fewest channels and never moves afterwards (with that many channels or fewer
each has its own connection, and a channel added or removed changes no other channel's
subscription: nothing is unsubscribed in between). Redis delivers a connection's messages
in order, so a flood queues behind itself only. Each subscription has its own reconnect
loop with backoff. A control is taken only for a session of the channel it was published
on (a frontend can publish on its own channel only). Pub/sub is at-most-once: once Redis
has confirmed a (re)subscription, ``on_subscribed`` runs so the worker can look for
control markers it may have missed while it was not listening.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from pydantic import ValidationError
from redis.asyncio import Redis
from redis.exceptions import RedisError

from bus_redis import ControlMessage, Keys
from bus_redis.codec import safe, strict_text, text
from bus_redis.keys import in_channel
from worker.runtime.backoff import Backoff

log = logging.getLogger(__name__)
JUNK_LOG_S = 60.0  # a control channel's junk is warned about once in this long
JUNK_NAMES = 1024  # control channel names whose junk is counted at most
CONTROL_CONNECTIONS = 16  # subscriptions per worker at most (channels share them beyond)
YIELD_EVERY = 8  # messages read in a row before the listener lets other tasks run
POLL_S = 0.25  # how often a subscription looks for channels to add or drop


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
        self._junk: dict[str, tuple[float, int]] = {}  # name -> (last warning, ignored since)
        self.subscribed = asyncio.Event()  # every wanted channel is being listened to
        self._want: list[set[str]] = [set() for _ in range(max(1, connections))]
        self._listening: list[set[str]] = [set() for _ in self._want]
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._changed = asyncio.Event()
        self.subscribed.set()

    def set_channels(self, channels: Iterable[str]) -> None:
        """The channels to listen to (called whenever the served channels change)."""
        wanted = set(channels)
        for shard in self._want:
            shard &= wanted
        placed = set().union(*self._want)
        for channel in sorted(wanted - placed):
            min(self._want, key=len).add(channel)  # the least loaded; never moved later
        self._update_subscribed()
        self._changed.set()

    async def run(self) -> None:
        """Keep a subscription task for every shard that has channels, until cancelled."""
        try:
            while True:
                self._changed.clear()
                for i, shard in enumerate(self._want):
                    if shard and (i not in self._tasks or self._tasks[i].done()):
                        self._tasks[i] = asyncio.create_task(self._subscription(i))
                await self._changed.wait()
        finally:
            tasks = list(self._tasks.values())
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _update_subscribed(self) -> None:
        if all(want <= have for want, have in zip(self._want, self._listening, strict=True)):
            self.subscribed.set()
        else:
            self.subscribed.clear()

    async def _subscription(self, i: int) -> None:
        backoff = Backoff(f"control subscription {i}", log)
        while True:
            pubsub = self.redis.pubsub()
            self._listening[i] = set()
            try:
                await self._sync(i, pubsub)
                backoff.reset()
                await self._listen(i, pubsub)
            except (RedisError, OSError) as exc:
                await backoff.after(exc)
            except Exception as exc:  # never let a subscription end: controls must work
                log.exception("control subscription failed")
                await backoff.after(exc)
            finally:
                self._listening[i] = set()
                self._update_subscribed()
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()

    async def _sync(self, i: int, pubsub: Any) -> None:
        """Subscribe the shard's new channels (then look for missed markers, once Redis
        confirmed them) and unsubscribe the channels it no longer serves."""
        have, want = self._listening[i], set(self._want[i])
        new = sorted(want - have)
        if new:
            names = {self.keys.control(c): c for c in new}
            await pubsub.subscribe(*names)
            pending = set(names)
            while pending:  # the confirmations: from here on nothing published is missed
                msg = await pubsub.get_message(timeout=5.0)
                if msg is None:
                    raise TimeoutError("no subscription confirmation from Redis")
                if msg.get("type") == "subscribe":
                    pending.discard(text(msg["channel"]))
                else:
                    self._take(msg)
            have |= set(new)
            self._update_subscribed()
            await self._after_subscribing()
        gone = sorted(have - want)
        if gone:
            await pubsub.unsubscribe(*(self.keys.control(c) for c in gone))
            have -= set(gone)

    async def _after_subscribing(self) -> None:
        try:
            await self.on_subscribed()
        except Exception:  # a failed look must not stop the subscription (nor the worker)
            log.exception("checking for missed controls failed")

    async def _listen(self, i: int, pubsub: Any) -> None:
        taken = 0
        while True:
            if self._want[i] != self._listening[i]:
                await self._sync(i, pubsub)
            taken += 1
            if taken % YIELD_EVERY == 0:  # a flood in the socket buffer never holds the
                await asyncio.sleep(0)  # event loop: turns, commits, other channels go on
            msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=POLL_S)
            if msg is not None:
                self._take(msg)

    def _ignored(self, name: str, why: str) -> None:
        """A junk message on control channel ``name``: one warning a minute per channel,
        with how many came since (a frontend's flood of ~20-byte PUBLISHes must not write
        a log line each on every worker); the rest at debug."""
        now = time.monotonic()
        if len(self._junk) > JUNK_NAMES and name not in self._junk:
            self._junk.clear()  # (names a pattern subscription let in: bounded)
        last, since = self._junk.get(name, (-JUNK_LOG_S, 0))
        if now - last >= JUNK_LOG_S:
            log.warning("ignored %d control message(s) on %s (%s)", since + 1, safe(name), why)
            self._junk[name] = (now, 0)
        else:
            log.debug("ignored a control message on %s (%s)", safe(name), why)
            self._junk[name] = (last, since + 1)

    def _take(self, msg: dict[str, Any]) -> None:
        if msg.get("type") != "message":
            return
        channel = self.keys.channel_of_control(text(msg["channel"]))
        data = strict_text(msg["data"])
        try:
            if data is None:
                raise ValueError("not UTF-8")
            control = ControlMessage.model_validate_json(data)
        except (ValidationError, ValueError):
            self._ignored(text(msg["channel"]), "malformed")
            return
        if channel is None or not in_channel(control.session_key, channel):
            self._ignored(text(msg["channel"]), "for another channel")
            return
        try:
            self.on_control(control)
        except Exception:  # one bad control must not end the subscription
            log.exception("handling a control for %s failed", safe(control.session_key))
