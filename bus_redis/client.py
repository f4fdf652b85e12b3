"""FrontendClient: what a gateway, bot or CLI uses to talk to the workers.

Everything here is plain Redis commands a frontend's ACL user may run for its own
channel (see ``bus_redis.acl``): no Lua, no consumer groups, nothing of another channel.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

from pydantic import ValidationError
from redis.asyncio import Redis
from redis.exceptions import NoPermissionError, ResponseError, WatchError

from bus_redis.aio import still_wanted
from bus_redis.codec import fields, text
from bus_redis.errors import SessionBusyError
from bus_redis.keys import Keys, channel_of
from bus_redis.mux import Multiplexed
from bus_redis.pulse import PulseWatch
from bus_redis.schema import (
    ControlMessage,
    FollowUp,
    InboundMessage,
    OpenTransient,
    OutboundMessage,
)
from bus_redis.streams import READY_MAXLEN

log = logging.getLogger(__name__)
EventCallback = Callable[[OutboundMessage], Awaitable[None] | None]


class FrontendClient:
    """Publish messages and controls of a session; read its events (README, wire v2)."""

    def __init__(
        self, redis: Redis, prefix: str = "agent", *, followup: FollowUp | None = None
    ) -> None:
        self.redis = redis
        self.keys = Keys(prefix)
        # this frontend's default double-texting mode for messages that name none
        # (``interrupt`` and ``reject`` are carried out here, when publishing)
        self.followup = followup
        self._mux: Multiplexed | None = None
        self._mux_tried = False

    async def aclose(self) -> None:
        """Close the connection :meth:`send` publishes over (not ``redis``, the caller's)."""
        if self._mux is not None:
            await self._mux.aclose()

    async def _publish(self, session_key: str, entry: dict[str, str]) -> str:
        """MULTI: XADD the session stream, ZADD NX its channel's queued index (the sweep's
        safety net), XADD its channel's ready queue. Returns the entry id. Over a
        multiplexed connection of this client's when ``redis`` allows one (bus_redis.mux:
        one write, no pool checkout), else redis-py's pipeline."""
        if not self._mux_tried:
            self._mux, self._mux_tried = Multiplexed.for_client(self.redis), True
        if self._mux is not None:
            channel = channel_of(session_key)
            ready = self.keys.ready(channel)
            entry_id, _, _ = await self._mux.transaction(
                ("XADD", self.keys.inbound(session_key), "*", *itertools.chain(*entry.items())),
                ("ZADD", self.keys.queued(channel), "NX", 0, session_key),
                ("XADD", ready, "MAXLEN", "~", READY_MAXLEN, "*", "session", session_key),
            )
            return text(entry_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xadd(self.keys.inbound(session_key), entry)  # type: ignore[arg-type]
            self._notify(pipe, session_key)
            entry_id, _, _ = await pipe.execute()
        return text(entry_id)

    def _notify(self, pipe: Any, session_key: str) -> None:
        """Queue, in ``pipe``: ZADD NX the channel's queued index, XADD its ready queue."""
        channel = channel_of(session_key)
        pipe.zadd(self.keys.queued(channel), {session_key: 0}, nx=True)
        pipe.xadd(
            self.keys.ready(channel),
            {"session": session_key},
            maxlen=READY_MAXLEN,
            approximate=True,
        )

    async def send(self, msg: InboundMessage) -> str:
        """Publish one message (as :meth:`send_entry`); returns its ``reply_to`` (the
        ``id``, else the entry id)."""
        entry_id = await self.send_entry(msg)
        return msg.id or entry_id

    async def send_entry(self, msg: InboundMessage) -> str:
        """Publish one message; returns its inbound entry id (the ``reply_to`` of an answer
        to a payload whose ``id`` could not be read).

        Double texting (``msg.followup``, else this client's default): ``interrupt`` adds
        an interrupt marker before the message (the running turn is cancelled, keeping its
        work up to its last complete tool exchange; everything pending runs next);
        ``reject`` raises ``SessionBusyError`` and queues nothing when a message of the
        session is queued or being answered; ``inject`` / ``queue`` are the worker's."""
        mode = msg.followup or self.followup
        if mode is not None and msg.followup is None:
            msg = msg.model_copy(update={"followup": mode})
        if mode == "interrupt":
            return await self._interrupt(msg)
        if mode == "reject":
            return await self._publish_unless_busy(msg)
        return await self._publish(msg.session_key, {"payload": _dump(msg)})

    async def _interrupt(self, msg: InboundMessage) -> str:
        """MULTI: an ``interrupt`` marker, then the message (as ``_publish``); then the
        pub/sub control naming the marker. The marker covers nothing queued (those run
        after, joining the next turn by the injection rules): it only cancels a turn of an
        entry before it."""
        s, channel = msg.session_key, channel_of(msg.session_key)
        async with self.redis.pipeline(transaction=True) as pipe:
            # no hint: an interrupt covers nothing, so nothing needs to look for it
            pipe.xadd(self.keys.inbound(s), {"control": "interrupt"})
            pipe.xadd(self.keys.inbound(s), {"payload": _dump(msg)})
            self._notify(pipe, s)
            marker, entry_id, _, _ = await pipe.execute()
        control = ControlMessage(op="interrupt", session_key=s, marker=text(marker))
        await self.redis.publish(self.keys.control(channel), _dump(control))
        return text(entry_id)

    async def _publish_unless_busy(self, msg: InboundMessage) -> str:
        """WATCH the session's stream: anything in it (a message queued or being answered)
        refuses this one; else the usual MULTI, retried when the stream changed between."""
        s = msg.session_key
        inbound = self.keys.inbound(s)
        async with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(inbound)
                    if int(await pipe.xlen(inbound)) > 0:
                        raise SessionBusyError(s)
                    pipe.multi()
                    pipe.xadd(inbound, {"payload": _dump(msg)})
                    self._notify(pipe, s)
                    entry_id, _, _ = await pipe.execute()
                    return text(entry_id)
                except WatchError:
                    continue

    async def send_raw(self, session_key: str, payload: str | bytes) -> str:
        """Publish an arbitrary payload (tests, replays of dead letters)."""
        return await self._publish(session_key, {"payload": payload})  # type: ignore[dict-item]

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
                self._terminal(msg.session_key, reply_to, after, on_event, seen), timeout_s
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
    ) -> OutboundMessage:
        async for ev in self.events([session_key], after=after):
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

    async def open_transient(
        self,
        channel: str,
        chat_id: str,
        *,
        session_key: str | None = None,
        disabled_tools: Iterable[str] = (),
        scope: str | None = None,
    ) -> tuple[str, str]:
        """Open a private session; returns ``(session_key, reply_to)``.

        Later messages for it must carry ``session_key_override=session_key`` and
        ``require_existing_session=True``.
        """
        key = session_key or f"{channel}:{chat_id}"
        op = OpenTransient(
            op="open_transient",
            id=uuid.uuid4().hex,
            channel=channel,
            chat_id=chat_id,
            session_key_override=key,
            scope=scope,
            disabled_tools=sorted(set(disabled_tools)),
        )
        await self._publish(key, {"payload": _dump(op)})
        return key, op.id or ""

    async def control(self, op: str, session_key: str) -> int:
        """Stop, discard or delete: a marker in the session's stream (it covers exactly the
        messages published before it), the hint that markers are queued, a notification,
        and the pub/sub message that cancels a running turn at once. Returns the number of
        workers that received the pub/sub message."""
        channel = channel_of(session_key)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xadd(self.keys.inbound(session_key), {"control": op})
            pipe.incr(self.keys.control_hint(session_key))
            self._notify(pipe, session_key)
            marker = text((await pipe.execute())[0])
        # published after the marker exists, naming it: the running turn is cancelled
        # without the worker reading the stream (one round trip less under load)
        msg = ControlMessage(op=op, session_key=session_key, marker=marker)  # type: ignore[arg-type]
        return int(await self.redis.publish(self.keys.control(channel), _dump(msg)))

    async def discard(self, session_key: str) -> int:
        return await self.control("discard", session_key)

    async def delete(self, session_key: str) -> int:
        """Discard, and delete the stored session and its events when the marker is
        reached (under the session's lease, so no running turn re-creates it)."""
        return await self.control("delete", session_key)

    async def stop(self, session_key: str) -> int:
        return await self.control("stop", session_key)

    async def new(self, session_key: str) -> int:
        """A fresh conversation in the same session, as nanobot's ``/new``: when the marker
        is reached, the stored history not consolidated yet is summarised into the
        scope's long-term memory, then deleted (a private session is discarded)."""
        return await self.control("new", session_key)


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


def _dump(doc: Any) -> str:
    return str(doc.model_dump_json(exclude_none=True))
