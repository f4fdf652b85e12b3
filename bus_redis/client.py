"""FrontendClient: what a gateway, bot or CLI uses to talk to the workers."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncGenerator, Iterable

from pydantic import ValidationError
from redis.asyncio import Redis
from redis.exceptions import RedisError, ResponseError

from bus_redis.codec import fields, text
from bus_redis.keys import Keys
from bus_redis.schema import ControlMessage, InboundMessage, OpenTransient, OutboundMessage
from bus_redis.scripts import Scripts
from bus_redis.streams import READY_MAXLEN

CONTROL_FLAG_TTL_MS = 60_000
log = logging.getLogger(__name__)


class FrontendClient:
    """Publish inbound messages and controls; read replies (SPEC 2.2-2.4)."""

    def __init__(self, redis: Redis, prefix: str = "agent") -> None:
        self.redis = redis
        self.keys = Keys(prefix)
        self._scripts = Scripts(redis)

    async def _publish(self, session_key: str, payload: str, *, direct: bool) -> str:
        """MULTI: XADD the session stream, XADD the shared ready queue. Returns the entry id."""
        note = {"session": session_key}
        if direct:
            note["direct"] = "1"
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xadd(self.keys.inbound(session_key), {"payload": payload})
            pipe.xadd(self.keys.ready, note, maxlen=READY_MAXLEN, approximate=True)  # type: ignore[arg-type]
            entry_id, _ = await pipe.execute()
        return text(entry_id)

    async def send(self, msg: InboundMessage) -> str:
        """Publish one message; returns its ``reply_to`` (the ``id``, else the entry id)."""
        entry_id = await self._publish(
            msg.session_key,
            msg.model_dump_json(exclude_none=True),
            direct=msg.session_key_override is None,
        )
        return msg.id or entry_id

    async def send_raw(self, session_key: str, payload: str, *, direct: bool = False) -> str:
        """Publish an arbitrary payload (tests, replays of dead letters)."""
        return await self._publish(session_key, payload, direct=direct)

    async def open_transient(
        self,
        channel: str,
        chat_id: str,
        *,
        session_key: str | None = None,
        disabled_tools: Iterable[str] = (),
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
            disabled_tools=sorted(set(disabled_tools)),
        )
        await self._publish(key, op.model_dump_json(exclude_none=True), direct=False)
        return key, op.id or ""

    async def control(self, op: str, session_key: str) -> int:
        """Publish a control and leave a short-lived flag for workers that miss it."""
        msg = ControlMessage(op=op, session_key=session_key)  # type: ignore[arg-type]
        keys = [self.keys.control_flag(session_key), self.keys.inbound(session_key)]
        args = [self.keys.control, op, msg.model_dump_json(), CONTROL_FLAG_TTL_MS]
        return int(await self._scripts.call("control", keys, args))

    async def discard(self, session_key: str) -> int:
        return await self.control("discard", session_key)

    async def stop(self, session_key: str) -> int:
        return await self.control("stop", session_key)

    async def _consumed(self, stream: str, group: str, entry_ids: list[str]) -> None:
        """Acknowledge and delete delivered replies. If Redis is gone they stay pending for
        this consumer (at-least-once), which is better than an error while closing."""
        try:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.xack(stream, group, *entry_ids)
                pipe.xdel(stream, *entry_ids)
                await pipe.execute()
        except (RedisError, OSError):
            log.warning("could not acknowledge %d replies on %s", len(entry_ids), stream)

    async def replies(
        self,
        channel: str,
        *,
        group: str = "frontends",
        consumer: str | None = None,
        block_ms: int = 1000,
        count: int = 100,
    ) -> AsyncGenerator[OutboundMessage, None]:
        """Read the channel's outbound stream with a consumer group, forever.

        Each entry is acknowledged and deleted once yielded: replies (transient ones
        above all) are not kept past delivery. A consumer with a stable name first gets
        what was delivered to it before but never acknowledged (at-least-once).
        """
        stream = self.keys.out(channel)
        consumer = consumer or uuid.uuid4().hex[:12]
        try:
            await self.redis.xgroup_create(stream, group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        position = "0"  # our own pending entries first, then new ones
        while True:
            block = None if position == "0" else block_ms
            reply = await self.redis.xreadgroup(
                group, consumer, {stream: position}, count=count, block=block
            )
            entries = [entry for _stream, batch in reply or [] for entry in batch]
            if position == "0" and not entries:
                position = ">"
                continue
            done: list[str] = []
            try:
                for entry_id, raw in entries:
                    done.append(entry_id)
                    try:
                        event = OutboundMessage.model_validate_json(fields(raw).get("payload", ""))
                    except ValidationError:
                        log.warning("skipped a malformed entry %s on %s", entry_id, stream)
                        continue
                    yield event
            finally:
                if done:  # one round trip per batch: acknowledge and delete what was yielded
                    await self._consumed(stream, group, done)
