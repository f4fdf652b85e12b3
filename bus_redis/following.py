"""EventFollower: the reading half of :class:`bus_redis.FrontendClient`: a session's
events as they come (``events``), and one message's answer (``ask``)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

from pydantic import ValidationError
from redis.asyncio import Redis
from redis.exceptions import NoPermissionError, ResponseError

from bus_redis.aio import still_wanted
from bus_redis.codec import fields, text
from bus_redis.keys import Keys, channel_of
from bus_redis.pulse import PulseWatch
from bus_redis.schema import InboundMessage, OutboundMessage

log = logging.getLogger("bus_redis.client")
EventCallback = Callable[[OutboundMessage], Awaitable[None] | None]


class EventFollower:
    """Reads the sessions' event streams (a base of ``FrontendClient``, which publishes)."""

    redis: Redis
    keys: Keys

    async def send(self, msg: InboundMessage) -> str:
        raise NotImplementedError  # FrontendClient's

    async def ask(
        self,
        msg: InboundMessage,
        *,
        timeout_s: float = 120.0,
        on_event: EventCallback | None = None,
    ) -> OutboundMessage:
        """Publish ``msg`` and return its terminal event (``message`` or ``error``).

        Non-terminal events of the same message (deltas, progress) go to ``on_event``.
        Only this message's events are looked at, so concurrent askers never take each
        other's replies. Raises ``TimeoutError``. For a private session
        (``require_existing_session``) the events read are deleted afterwards.
        """
        if msg.id is None:
            msg = msg.model_copy(update={"id": uuid.uuid4().hex})
        reply_to = msg.id or ""
        after = await self._last_id(self.keys.out(msg.session_key))  # events of this ask follow
        await self.send(msg)
        seen: list[str] = []
        try:
            return await asyncio.wait_for(
                self._terminal(
                    msg.session_key,
                    reply_to,
                    after,
                    on_event,
                    seen,
                    private=msg.require_existing_session,
                ),
                timeout_s,
            )
        finally:
            if msg.require_existing_session and seen:
                await self.redis.xdel(self.keys.out(msg.session_key), *seen)

    async def _terminal(
        self,
        session_key: str,
        reply_to: str,
        after: str,
        on_event: EventCallback | None,
        seen: list[str],
        *,
        private: bool = False,
    ) -> OutboundMessage:
        async for ev in self.events([session_key], after=after):
            if private and ev.is_loss_notice:  # its answer, if any, went with the session
                seen.append(ev.entry_id or "")
                return ev
            if ev.reply_to != reply_to and reply_to not in (ev.covers or []):
                continue
            seen.append(ev.entry_id or "")
            if ev.is_terminal:
                return ev
            if on_event is not None:
                result = on_event(ev)
                if result is not None:
                    await result
        raise AssertionError("unreachable: events() never ends")

    async def events(
        self,
        session_keys: Iterable[str],
        *,
        after: str | dict[str, str] = "$",
        block_ms: int = 1000,
        count: int = 100,
    ) -> AsyncIterator[OutboundMessage]:
        """Every event of the given sessions, forever, in order per session.

        ``after`` is the resume point: ``"$"`` (only new events), ``"0"`` (everything
        still kept), a stream id, or a per-session dict. Each event's ``entry_id`` is
        the point to resume from on any replica after a reconnect: nothing is lost or
        doubled. Events are kept for a bounded time and length (``AGENT_REPLY_TTL_MS``,
        ``AGENT_REPLY_MAXLEN``); reading does not consume them. Following more than
        ``PULSE_ABOVE`` sessions, it blocks on their channels' pulses (``bus_redis.pulse``)
        and reads only the streams they name: a wake-up costs what happened, not how many
        are followed.
        """
        keys = list(dict.fromkeys(session_keys))
        position = {
            self.keys.out(k): (after.get(k, "$") if isinstance(after, dict) else after)
            for k in keys
        }
        watch = None
        if len(keys) > PULSE_ABOVE:  # many sessions: block on their channels' pulses
            watch = PulseWatch(self.redis, self.keys)
            watch = await _watching(watch, {channel_of(k) for k in keys})
        for stream, pos in position.items():  # "$" once, as an id: nothing slips between reads
            if pos == "$":
                position[stream] = await self._last_id(stream)
        pending = set(position)  # first, whatever is kept after the positions
        while watch is not None:
            while pending:
                wanted = {s: position[s] for s in pending}
                reply = await self._read(wanted, count=count, block_ms=None)
                for event in self._decode(position, reply):
                    yield event
                pending = {text(s) for s, batch in reply or [] if len(batch) >= count}
            try:
                named, _ = await watch.wait(block_ms)
            except NoPermissionError:
                log.warning(_NO_PULSE)
                break  # read as before pulses: blocked on every followed stream
            still_wanted()
            pending = set(position) if named is None else named & position.keys()
        while True:
            reply = await self._read(position, count=count, block_ms=block_ms)
            for event in self._decode(position, reply):
                yield event

    async def _read(self, position: dict[str, str], *, count: int, block_ms: int | None) -> Any:
        try:
            reply = await self.redis.xread(position, count=count, block=block_ms)  # type: ignore[arg-type]
        except ResponseError as exc:  # a key that is no stream (junk): the next commit
            if "WRONGTYPE" not in str(exc):  # of its session replaces it
                raise
            reply = await self._read_streams_only(position, count=count)
        still_wanted()
        return reply

    @staticmethod
    def _decode(position: dict[str, str], reply: Any) -> Iterable[OutboundMessage]:
        for stream, batch in reply or []:
            for eid, raw in batch:
                position[text(stream)] = text(eid)
                try:
                    event = OutboundMessage.model_validate_json(fields(raw).get("payload", ""))
                except ValidationError:
                    log.warning("skipped a malformed event %s on %s", text(eid), text(stream))
                    continue
                event.entry_id = text(eid)
                yield event

    async def _last_id(self, stream: str) -> str:
        try:
            last = await self.redis.xrevrange(stream, "+", "-", count=1)
        except ResponseError as exc:
            if "WRONGTYPE" not in str(exc):
                raise
            return "0-0"  # junk where the events belong: the next commit replaces it
        return text(last[0][0]) if last else "0-0"

    async def _read_streams_only(self, position: dict[str, str], *, count: int) -> Any:
        """Read the keys that are streams now (no blocking: a junk key is being replaced)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for stream in position:
                pipe.type(stream)
            kinds = await pipe.execute()
        ok = {
            s: p for (s, p), k in zip(position.items(), kinds, strict=True) if text(k) == "stream"
        }
        await asyncio.sleep(0.05)  # back off while the junk is there
        return await self.redis.xread(ok, count=count) if ok else []  # type: ignore[arg-type]


PULSE_ABOVE = 8  # following more sessions than this, events() blocks on the pulses
_NO_PULSE = (
    "this Redis user may not read the channel's pulse (ACL lines from before pulses): "
    "blocking on every followed stream instead; re-apply `agent-worker acl frontend`"
)


async def _watching(watch: PulseWatch, channels: set[str]) -> PulseWatch | None:
    try:
        await watch.add_channels(channels)
    except NoPermissionError:
        log.warning(_NO_PULSE)
        return None
    return watch
