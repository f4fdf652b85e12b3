"""FrontendClient: what a gateway, bot or CLI uses to talk to the workers.

Everything here is plain Redis commands a frontend's ACL user may run for its own
channel (see ``bus_redis.acl``): no Lua, no consumer groups, nothing of another channel.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Protocol

from redis.asyncio import Redis
from redis.exceptions import WatchError

from bus_redis.codec import text
from bus_redis.errors import SessionBusyError
from bus_redis.following import EventFollower
from bus_redis.keys import Keys, channel_of
from bus_redis.mux import Multiplexed
from bus_redis.schema import (
    ControlMessage,
    FollowUp,
    InboundMessage,
    OpenTransient,
)
from bus_redis.streams import READY_MAXLEN

Reader = Callable[[list[tuple[Any, ...]]], Awaitable[list[Any]]]


class Guard(Protocol):
    """What a publisher adds to the transaction that writes to a session's stream (the
    gateway's per-user bounds, ``gateway.backlog``). The stream and the guard's ``watch``
    keys are WATCHed (one command: the ACL user needs ``WATCH`` on all of them in one
    selector); then the stream's length and the guard's ``reads`` are read at once;
    ``check`` gets their replies (as the server sent them: bytes) and a reader for more,
    and raises to refuse (nothing is written); ``queue`` adds its writes to the MULTI. A
    change to a watched key between the WATCH and ``EXEC`` runs it all again."""

    @property
    def watch(self) -> Sequence[str]: ...

    def reads(self) -> list[tuple[Any, ...]]:
        """Read-only commands whose replies, in order, go to ``check``."""

    async def check(self, replies: list[Any], waiting: int, adding: int, read: Reader) -> None:
        """``waiting``: the stream's length now; ``adding``: the entries this write adds."""

    def queue(self, pipe: Any) -> None: ...


class FrontendClient(EventFollower):
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

    async def _publish(
        self, session_key: str, entry: dict[str, str], guard: Guard | None = None
    ) -> str:
        """MULTI: XADD the session stream, ZADD NX its channel's queued index (the sweep's
        safety net), XADD its channel's ready queue. Returns the entry id. Over a
        multiplexed connection of this client's when ``redis`` allows one (bus_redis.mux:
        one write, no pool checkout), else redis-py's pipeline; under WATCH with a guard."""
        if guard is not None:

            def write(pipe: Any) -> None:
                pipe.xadd(self.keys.inbound(session_key), entry)
                self._notify(pipe, session_key)

            return text((await self._guarded(session_key, guard, write, 1))[0])
        mux = self._multiplexed()
        if mux is not None:
            channel = channel_of(session_key)
            ready = self.keys.ready(channel)
            entry_id, _, _ = await mux.transaction(
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

    def _multiplexed(self) -> Multiplexed | None:
        """This client's multiplexed connection (made on first use), or None when
        ``redis``'s settings cannot be reproduced by one (bus_redis.mux)."""
        if not self._mux_tried:
            self._mux, self._mux_tried = Multiplexed.for_client(self.redis), True
        return self._mux

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

    async def send_entry(self, msg: InboundMessage, *, guard: Guard | None = None) -> str:
        """Publish one message; returns its inbound entry id (the ``reply_to`` of an answer
        to a payload whose ``id`` could not be read).

        Double texting (``msg.followup``, else this client's default): ``interrupt`` adds
        an interrupt marker before the message (the running turn is cancelled, keeping its
        work up to its last complete tool exchange; everything pending runs next);
        ``reject`` raises ``SessionBusyError`` and queues nothing when a message of the
        session is queued or being answered; ``inject`` / ``queue`` are the worker's.
        ``guard``: checks and writes of the caller's in the same transaction (:class:`Guard`)."""
        mode = msg.followup or self.followup
        if mode is not None and msg.followup is None:
            msg = msg.model_copy(update={"followup": mode})
        if mode == "interrupt":
            return await self._interrupt(msg, guard)
        if mode == "reject":
            return await self._publish_unless_busy(msg, guard)
        return await self._publish(msg.session_key, {"payload": _dump(msg)}, guard)

    async def _interrupt(self, msg: InboundMessage, guard: Guard | None = None) -> str:
        """MULTI: an ``interrupt`` marker, then the message (as ``_publish``); then the
        pub/sub control naming the marker. The marker covers nothing queued (those run
        after, joining the next turn by the injection rules): it only cancels a turn of an
        entry before it."""
        s, channel = msg.session_key, channel_of(msg.session_key)

        def write(pipe: Any) -> None:
            # no hint: an interrupt covers nothing, so nothing needs to look for it
            pipe.xadd(self.keys.inbound(s), {"control": "interrupt"})
            pipe.xadd(self.keys.inbound(s), {"payload": _dump(msg)})
            self._notify(pipe, s)

        if guard is not None:
            marker, entry_id = (await self._guarded(s, guard, write, 2))[:2]
        else:
            async with self.redis.pipeline(transaction=True) as pipe:
                write(pipe)
                marker, entry_id, _, _ = await pipe.execute()
        control = ControlMessage(op="interrupt", session_key=s, marker=text(marker))
        await self.redis.publish(self.keys.control(channel), _dump(control))
        return text(entry_id)

    async def _publish_unless_busy(self, msg: InboundMessage, guard: Guard | None = None) -> str:
        """WATCH the session's stream: anything in it (a message queued or being answered)
        refuses this one; else the usual MULTI, retried when the stream changed between."""
        s = msg.session_key

        def write(pipe: Any) -> None:
            pipe.xadd(self.keys.inbound(s), {"payload": _dump(msg)})
            self._notify(pipe, s)

        return text((await self._guarded(s, guard, write, 1, reject=True))[0])

    async def _guarded(
        self,
        session_key: str,
        guard: Guard | None,
        write: Callable[[Any], None],
        adding: int,
        *,
        reject: bool = False,
    ) -> list[Any]:
        """``write`` (``adding`` entries to the session's stream) in a MULTI under WATCH of
        the stream and the guard's keys, after its checks (and, with ``reject``, after
        finding the stream empty); run again when a watched key changed. Returns the
        replies of ``write``'s commands, then of the guard's."""
        inbound = self.keys.inbound(session_key)
        async with self.redis.pipeline(transaction=True) as pipe:

            async def read(commands: list[tuple[Any, ...]]) -> list[Any]:
                """After the WATCH, never on a second pooled connection (callers holding
                a bounded pool's connections in WATCH would wait for each other): over this
                client's multiplexed connection (one write), else one by one on ``pipe``'s."""
                mux = self._multiplexed()
                if mux is not None:
                    return list(await asyncio.gather(*(mux.execute(*c) for c in commands)))
                return [await pipe.execute_command(*c) for c in commands]

            while True:
                try:
                    await pipe.watch(inbound, *(guard.watch if guard is not None else ()))
                    commands: list[tuple[Any, ...]] = [("XLEN", inbound)]
                    replies = await read(commands + (guard.reads() if guard else []))
                    waiting = int(replies[0])
                    if reject and waiting > 0:
                        raise SessionBusyError(session_key)
                    if guard is not None:
                        await guard.check(replies[1:], waiting, adding, read)
                    pipe.multi()
                    write(pipe)
                    if guard is not None:
                        guard.queue(pipe)
                    return list(await pipe.execute())
                except WatchError:
                    continue

    async def send_raw(self, session_key: str, payload: str | bytes) -> str:
        """Publish an arbitrary payload (tests, replays of dead letters)."""
        return await self._publish(session_key, {"payload": payload})  # type: ignore[dict-item]

    async def open_transient(
        self,
        channel: str,
        chat_id: str,
        *,
        session_key: str | None = None,
        disabled_tools: Iterable[str] = (),
        scope: str | None = None,
        guard: Guard | None = None,
    ) -> tuple[str, str]:
        """Open a private session; returns ``(session_key, reply_to)``.

        Later messages for it must carry ``session_key_override=session_key`` and
        ``require_existing_session=True``. Without ``session_key``, a key of its own
        (``<channel>:<chat_id>-private-<random>``), never the chat's durable one: the two
        would share a stream, and in unified mode the key stays marked private.
        """
        key = session_key or f"{channel}:{chat_id}-private-{uuid.uuid4().hex[:16]}"
        op = OpenTransient(
            op="open_transient",
            id=uuid.uuid4().hex,
            channel=channel,
            chat_id=chat_id,
            session_key_override=key,
            scope=scope,
            disabled_tools=sorted(set(disabled_tools)),
        )
        await self._publish(key, {"payload": _dump(op)}, guard)
        return key, op.id or ""

    async def control(self, op: str, session_key: str, *, guard: Guard | None = None) -> int:
        """Stop, discard or delete: a marker in the session's stream (it covers exactly the
        messages published before it), the hint that markers are queued, a notification,
        and the pub/sub message that cancels a running turn at once. Returns the number of
        workers that received the pub/sub message."""

        def write(pipe: Any) -> None:
            self.queue_control(pipe, op, session_key)

        if guard is not None:
            marker = text((await self._guarded(session_key, guard, write, 1))[0])
        else:
            async with self.redis.pipeline(transaction=True) as pipe:
                write(pipe)
                marker = text((await pipe.execute())[0])
        # published after the marker exists, naming it: the running turn is cancelled
        # without the worker reading the stream (one round trip less under load)
        return await self.announce(op, session_key, marker)

    def queue_control(self, pipe: Any, op: str, session_key: str) -> None:
        """A control's writes, queued in ``pipe`` (a guard's MULTI may carry controls of
        other sessions): the marker (the first reply), the hint, the notification. The
        pub/sub message is the caller's to publish after (:meth:`announce`)."""
        pipe.xadd(self.keys.inbound(session_key), {"control": op})
        pipe.incr(self.keys.control_hint(session_key))
        self._notify(pipe, session_key)

    async def announce(self, op: str, session_key: str, marker: str | None = None) -> int:
        """The pub/sub message of a control whose marker is written: a running turn of an
        entry before it is cancelled at once (without ``marker``, the worker finds the
        marker in the stream first)."""
        msg = ControlMessage(op=op, session_key=session_key, marker=marker)  # type: ignore[arg-type]
        return int(await self.redis.publish(self.keys.control(channel_of(session_key)), _dump(msg)))

    async def discard(self, session_key: str, *, guard: Guard | None = None) -> int:
        return await self.control("discard", session_key, guard=guard)

    async def delete(self, session_key: str, *, guard: Guard | None = None) -> int:
        """Discard, and delete the stored session and its events when the marker is
        reached (under the session's lease, so no running turn re-creates it)."""
        return await self.control("delete", session_key, guard=guard)

    async def stop(self, session_key: str, *, guard: Guard | None = None) -> int:
        return await self.control("stop", session_key, guard=guard)

    async def new(self, session_key: str, *, guard: Guard | None = None) -> int:
        """A fresh conversation in the same session, as nanobot's ``/new``: when the marker
        is reached, the stored history not consolidated yet is summarised into the
        scope's long-term memory, then deleted (a private session is discarded)."""
        return await self.control("new", session_key, guard=guard)


def _dump(doc: Any) -> str:
    return str(doc.model_dump_json(exclude_none=True))
