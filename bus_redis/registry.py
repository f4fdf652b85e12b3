"""Registry: the periodic, worker-side bookkeeping on Redis.

Channels (registered and discovered), transient owner records, the stranded-stream sweep,
control markers missed while unsubscribed, worker heartbeats and clean-up of dead
workers' inboxes and consumers.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterable, Sequence

from redis.exceptions import NoScriptError

from bus_redis.codec import safe, server_ms, stream_id_ms, strict_text, text, texts
from bus_redis.keys import channel_of, valid_channel
from bus_redis.schema import CONTROL_OPS, OutboundMessage
from bus_redis.scripts import script_sha
from bus_redis.streams import WORKER_GROUP, RedisBus
from bus_redis.sweeps import SCAN_COUNT, Sweeps

DISCOVER_STEPS = 10  # SCAN steps per discovery call (each visits SCAN_COUNT keys)
LOST = "the worker holding this private session is gone"
log = logging.getLogger(__name__)


def lost_event(member: str, why: str = LOST) -> str:
    """The ``session_lost`` event of the private session registered as ``member``."""
    key, channel, chat_id = json.loads(member)
    out = OutboundMessage(
        type="error", channel=channel, chat_id=chat_id, session_key=key,
        code="session_lost", content=why,
    )  # fmt: skip
    return out.model_dump_json(exclude_none=True)


def _member_key(member: str) -> str:
    try:
        doc = json.loads(member)
    except ValueError:
        return ""
    return str(doc[0]) if isinstance(doc, list) and doc else ""


def published_before(marker: str, end: str) -> bool:
    """Whether stream entry ``marker`` was published before private session end ``end``
    (``Keys.private_end``): ``<ms>:<id>`` (when it ended and the last entry then: an
    earlier millisecond, or that one up to the id), a provisional ``<ms>|<member>`` (open;
    its opening's record ran out at ``ms``), or Redis ms (a worker before stop 47). Junk
    (only workers write the key) is no end."""
    try:
        at = stream_id_ms(marker)
        ms, sep, _ = end.partition("|")
        if sep:
            return at <= int(ms)
        ms, sep, last = end.partition(":")
        if not sep:
            return at <= int(ms)
        return at < int(ms) or (at == int(ms) and _id(marker) <= _id(last))
    except ValueError:
        return False


def _id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


class Registry:
    def __init__(self, bus: RedisBus) -> None:
        self.bus = bus
        self.redis = bus.redis
        self.keys = bus.keys
        self.sweeps = Sweeps(bus)

    # --- channels -------------------------------------------------------------------
    async def register_channel(self, channel: str) -> None:
        await self.redis.sadd(self.keys.channels, channel)  # type: ignore[misc]

    async def registered_channels(self) -> set[str]:
        """The channels in ``P:channels`` (one cheap read: every worker, every tick)."""
        members = await self.bus.raw.smembers(self.keys.channels)  # type: ignore[misc]
        return {c for c in (strict_text(m) for m in members) if c and valid_channel(c)}

    async def discover_channels(self, *, steps: int | None = DISCOVER_STEPS) -> set[str]:
        """Channels whose ready queue exists but that nobody registered (nor removed), found
        by SCAN and registered for all workers. At most ``steps`` SCAN steps of ``SCAN_COUNT`` keys per
        call, resumed where the last call (of any worker) stopped (``P:discovery``): a full
        pass over a keyspace of K keys takes K / (steps * SCAN_COUNT) calls, and no call
        does work in proportion to what the channels wrote. ``steps=None``: the whole
        keyspace at once, from its start (administration), leaving the shared cursor."""
        found: set[str] = set()
        cursor = 0
        if steps is not None:
            kept = strict_text(await self.bus.raw.get(self.keys.discovery))
            cursor = (
                int(kept) if kept and kept.isascii() and kept.isdigit() and len(kept) <= 20 else 0
            )
            if cursor >= 2**64:  # not a cursor Redis gave: start over
                cursor = 0
        done = 0
        while steps is None or done < steps:
            cursor, keys = await self.bus.raw.scan(
                cursor, match=self.keys.ready_pattern, count=SCAN_COUNT, _type="stream"
            )
            done += 1
            for key in keys:
                name = strict_text(key)
                channel = self.keys.channel_of_ready(name) if name else None
                if channel is not None:
                    found.add(channel)
            if cursor == 0:
                break
        if steps is not None:
            await self.bus.raw.set(self.keys.discovery, cursor)
        if found:  # an operator's `channels remove` stands until `channels add`
            removed = await self.bus.raw.smembers(self.keys.removed_channels)  # type: ignore[misc]
            found -= {strict_text(m) for m in removed}
        if found:
            await self.redis.sadd(self.keys.channels, *found)  # type: ignore[misc]
        return found

    async def channels(self) -> set[str]:
        """Registered channels and channels whose ready queue exists (administration)."""
        return await self.registered_channels() | await self.discover_channels(steps=None)

    # --- transient owners -----------------------------------------------------------
    def _owner_keys(self, key: str) -> list[str]:
        k = self.keys
        return [k.owner(key), k.owners(channel_of(key)), k.out(key), k.private_mark(key),
                k.private_end(key), k.inbound(key)]  # fmt: skip

    async def renew_owner(self, key: str, worker_id: str, member: str) -> bool:
        args = ["renew", worker_id, member, self.bus.owner_ttl_ms, self._mark_ms]
        args.append(self.bus.private_end_ms)
        return bool(await self.bus.scripts.call("owner", self._owner_keys(key), args))

    async def opening_owner(self, key: str, member: str) -> None:
        """Per-session mode: the private session ``member`` is being opened on ``key``: its
        provisional end is written before its record (``owner.lua``), so that the loss of
        a worker killed before its first renewal is an end too."""
        if self.bus.private_end_ms:
            args = ["open", "", member, self.bus.owner_ttl_ms, 0, self.bus.private_end_ms]
            await self.bus.scripts.call("owner", self._owner_keys(key), args)

    async def drop_owner(self, key: str, worker_id: str, member: str) -> None:
        args = ["drop", worker_id, member, 0, self._mark_ms, self.bus.private_end_ms]
        await self.bus.scripts.call("owner", self._owner_keys(key), args)

    async def abandon_owner(self, key: str, worker_id: str) -> None:
        """Delete our owner record but keep its registry entry, so that
        :meth:`report_owner_lost` tells the frontend."""
        args = ["abandon", worker_id, "", 0, self._mark_ms, self.bus.private_end_ms]
        await self.bus.scripts.call("owner", self._owner_keys(key), args)

    async def private_end(self, key: str) -> str | None:
        """Per-session mode: where the private session last open on ``key`` ended, if it
        ended lately (``Keys.private_end``: an entry id of its inbound stream), or, while
        it is open, ``<ms>|<member>`` (its registry member; when its opening's record
        would run out)."""
        raw = await self.redis.get(self.keys.private_end(key))
        return None if raw is None else text(raw)

    async def new_was_private(self, key: str, marker: str) -> bool:
        """Per-session mode: whether the ``new`` marker ``marker`` of ``key`` was published
        while a private session was open on it (its own: a discard). One that was open when
        last renewed, and whose record ran out (its worker was killed), is reported lost
        first (as a maintenance tick would): its end is then where it was reported."""
        end = await self.private_end(key)
        if end is not None and "|" in end:
            member = end.partition("|")[2]
            with contextlib.suppress(ValueError, TypeError, IndexError):
                if json.loads(member)[0] == key:
                    reported = await self.report_owner_lost(member, lost_event(member))
                    if not reported and await self.redis.exists(self.keys.owner(key)):
                        return True  # open (its worker holds the key again)
                    end = await self.private_end(key)
        return end is not None and published_before(marker, end)

    async def owner_of(self, key: str) -> str | None:
        """The worker whose private session is open on ``key`` now, if any."""
        owner = await self.redis.hget(self.keys.owner(key), "worker")  # type: ignore[misc]
        return None if owner is None else text(owner)

    @property
    def _mark_ms(self) -> int:
        return self.bus.private_mark_ms

    async def was_private(self, key: str) -> bool:
        """Whether ``key`` was opened as a private session (unified mode: its mark
        outlives it by ``RedisBus.private_mark_ms``)."""
        return bool(await self.redis.exists(self.keys.private_mark(key)))

    async def due_owners(self, channels: Iterable[str], *, limit: int = 100) -> list[str]:
        now_ms = await server_ms(self.redis)  # the registry is stamped with Redis time
        due: list[str] = []
        for channel in channels:
            members = await self.redis.zrangebyscore(
                self.keys.owners(channel), "-inf", now_ms, 0, limit
            )
            due += texts(members)
        return due

    async def owned_by(self, worker_id: str, channels: Iterable[str]) -> list[tuple[str, str]]:
        """``(key, registry member)`` of the private sessions whose owner record names
        ``worker_id`` (a former life's, at a start under the same id), read about 1,000 at
        a time: a channel's registry holds at most its workers' private session caps. By
        ``ZSCAN``, which returns every member there from start to end whatever others add
        or remove meanwhile (paging by rank skipped one when a member before it went)."""
        found: dict[str, str] = {}
        for channel in channels:
            owners, cursor = self.keys.owners(channel), 0
            while True:
                cursor, page = await self.redis.zscan(owners, cursor, count=1000)
                batch = [text(member) for member, _ in page]
                keys = [_member_key(member) for member in batch]
                async with self.redis.pipeline(transaction=False) as pipe:
                    for key in keys:
                        pipe.hget(self.keys.owner(key), "worker")
                    holders = await pipe.execute()
                for key, member, holder in zip(keys, batch, holders, strict=True):
                    if key and text(holder) == worker_id:
                        found[member] = key  # (a member may come twice)
                if not int(cursor):
                    break
        return [(key, member) for member, key in found.items()]

    async def report_owner_lost(self, member: str, event_json: str) -> bool:
        key = json.loads(member)[0]
        k = self.keys
        keys = [k.owner(key), k.owners(channel_of(key)), k.out(key), k.ready(channel_of(key))]
        keys += [k.pulse(channel_of(key)), k.private_end(key), k.inbound(key)]
        retention = self.bus.retention
        args = [member, event_json, key, retention.maxlen, retention.transient_ttl_ms]
        args.append(self.bus.private_end_ms)
        return bool(await self.bus.scripts.call("owner_lost", keys, args))

    async def unserved(self, keys: Sequence[str]) -> list[str]:
        """Those of ``keys`` with queued inbound entries and no lease holder."""
        if not keys:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.xlen(self.keys.inbound(key))
                pipe.exists(self.keys.lease(key))
            res = await pipe.execute()
        return [k for i, k in enumerate(keys) if int(res[2 * i]) > 0 and not int(res[2 * i + 1])]

    # --- failed deliveries --------------------------------------------------------------
    async def note_failure(self, member: str, entry_id: str, cause: str) -> None:
        """Remember why a turn failed, for the dead letter written after the last attempt."""
        await self.redis.hset(self.keys.attempts(member), f"{entry_id}:error", cause[:200])  # type: ignore[misc]

    async def last_failure(self, member: str, entry_id: str) -> str:
        return text(await self.redis.hget(self.keys.attempts(member), f"{entry_id}:error"))  # type: ignore[misc]

    # --- sweeps ---------------------------------------------------------------------
    async def take_sweep_turn(self, worker_id: str, period_ms: int) -> bool:
        """One worker per period runs the stranded-stream sweep."""
        return bool(await self.redis.set(self.keys.sweeper, worker_id, nx=True, px=period_ms))

    async def markers_step(
        self, running: dict[str, tuple[str, str]], resume: dict[str, str] | None = None
    ) -> tuple[dict[str, str], dict[str, str]]:
        """One bounded step for each running turn ``{K: (S, entry id)}``, in one pipelined
        round trip: ``(found, again)`` — the op of the first control marker queued after
        the running entry, and where to go on for turns whose step read its whole budget
        without an answer (``lua/markers.lua``; each entry is read once however many
        controls ask, thanks to memos in the stream's attempts hash)."""
        todo = {key: v for key, v in running.items() if v[1]}
        if not todo:
            return {}, {}
        resume = resume or {}
        k = self.keys
        for _ in range(2):  # a server that lost its scripts (restart) gets them again
            async with self.redis.pipeline(transaction=False) as pipe:
                for key, (member, entry_id) in todo.items():
                    keys = [k.inbound(member), k.attempts(member), k.control_hint(member)]
                    pipe.evalsha(script_sha("markers"), 3, *keys, entry_id, resume.get(key, ""))
                replies = await pipe.execute(raise_on_error=False)
            if not any(isinstance(r, NoScriptError) for r in replies):
                break
            await self.bus.scripts.load_all()
        found: dict[str, str] = {}
        again: dict[str, str] = {}
        for key, reply in zip(todo, replies, strict=True):
            if isinstance(reply, Exception):  # this session's keys only: the others go on
                log.warning("looking for markers of %s failed: %s", safe(key), safe(str(reply)))
                continue
            parts = texts(reply)
            if parts and parts[0] in CONTROL_OPS:
                found[key] = parts[0]
            elif parts and parts[0] == "again":
                again[key] = parts[1]
        return found, again

    async def markers_after(self, running: dict[str, tuple[str, str]]) -> dict[str, str]:
        """Steps until every running turn has its answer (tests, administration)."""
        found, again = await self.markers_step(running)
        while again:
            more, again = await self.markers_step({k: running[k] for k in again}, again)
            found.update(more)
        return found

    # --- workers --------------------------------------------------------------------
    async def heartbeat(
        self, worker_id: str, info: dict[str, str], ttl_ms: int, *, mode: str = "", claim: str = ""
    ) -> tuple[str, str] | None:
        """The worker's record; with ``mode``, the deployment's mode is set again where it
        is missing (a Redis restarted without persistence forgot it, and a worker of
        another mode must still be refused at its start). Stamped with Redis's clock:
        workers on hosts whose clocks differ are judged alike. With ``claim`` (the one
        this process took the id with), nothing is written when another process claimed
        the id since: its ``(host, pid)`` is returned (``heartbeat.lua``)."""
        keys = [self.keys.worker_info(worker_id), self.keys.workers, self.keys.mode]
        args: list[str | int] = [worker_id, claim, ttl_ms, mode]
        for field, value in info.items():
            args += [field, value]
        reply = await self.bus.scripts.call("heartbeat", keys, args)
        if reply == 1:
            return None
        host, pid = texts(reply)
        return host, pid

    async def declared_liveness(self, worker_id: str) -> int:
        """The ``AGENT_LIVENESS_MS`` a worker's heartbeat declares (0: none known)."""
        raw = await self.redis.hget(self.keys.worker_info(worker_id), "liveness_ms")  # type: ignore[misc]
        try:
            return max(0, int(text(raw) or 0))
        except ValueError:
            return 0

    async def leave(self, worker_id: str, streams: Sequence[str]) -> None:
        """Deregister: heartbeat record, inbox, and our consumer in every group."""
        for stream in streams:
            if stream != self.keys.inbox(worker_id):
                await self._delete_consumer(stream, worker_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zrem(self.keys.workers, worker_id)
            pipe.delete(self.keys.worker_info(worker_id), self.keys.inbox(worker_id))
            await pipe.execute()

    async def prune_dead_workers(self, *, older_than_ms: int, streams: Sequence[str]) -> list[str]:
        """Forget workers whose heartbeat stopped: their inbox, heartbeat entry and idle
        consumers without pending entries (entries still pending are claimed first)."""
        cutoff = await server_ms(self.redis) - older_than_ms
        dead = texts(await self.redis.zrangebyscore(self.keys.workers, "-inf", cutoff))
        for worker_id in dead:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.zrem(self.keys.workers, worker_id)
                pipe.delete(self.keys.inbox(worker_id), self.keys.worker_info(worker_id))
                await pipe.execute()
        for stream in streams:
            if ":worker:" in stream:
                continue
            for c in await self.redis.xinfo_consumers(stream, WORKER_GROUP):
                if int(c["pending"]) == 0 and int(c["idle"]) > older_than_ms:
                    await self._delete_consumer(stream, text(c["name"]))
        return dead

    async def _delete_consumer(self, stream: str, consumer: str) -> None:
        await self.redis.xgroup_delconsumer(stream, WORKER_GROUP, consumer)
