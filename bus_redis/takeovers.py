"""Dead holders: each worker's liveness beat (``P:alive``), who has been silent too long,
and the takeover of a silent worker's leases (deleted, the sessions re-notified at once, so
any worker acquires them with a new nonce). The part of :class:`bus_redis.sweeps.Sweeps`
that item 7 of issue 15 (failover in a second) rests on; each step is bounded per channel.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from redis.asyncio import Redis

from bus_redis.codec import text, texts
from bus_redis.keys import UNIFIED_CHANNEL, Keys
from bus_redis.queue import READY_MAXLEN
from bus_redis.streams import RedisBus

LEASES_LOOKED_AT = 4096  # lease-registry members read per channel in a takeover


def unified_flag(channel: str) -> str:
    """'1' for the unified channel, whose key's notifications are marked effective."""
    return "1" if channel == UNIFIED_CHANNEL else "0"


class Takeovers:
    """The dead-holder half of ``Sweeps`` (which sets the attributes below)."""

    bus: RedisBus
    redis: Redis
    keys: Keys

    async def beat(self, worker_id: str) -> int:
        """This worker is alive (Redis time, ms); see ``lua/beat.lua``."""
        return int(text(await self.bus.scripts.call("beat", [self.keys.alive], [worker_id])))

    async def dead_workers(
        self, dead_after_ms: int, *, forget_after_ms: int, limit: int = 16
    ) -> list[str]:
        """Workers whose liveness beat is older than ``dead_after_ms`` against the freshest
        beat, most recently silent first; entries older than ``forget_after_ms`` are
        removed (see ``lua/dead.lua``)."""
        args = [dead_after_ms, limit, forget_after_ms]
        return texts(await self.bus.scripts.call("dead", [self.keys.alive], args))

    async def still_dead(self, worker_id: str, dead_after_ms: int) -> bool:
        """Whether ``worker_id`` is still silent (it may beat again: a restart)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zscore(self.keys.alive, worker_id)
            pipe.zrevrange(self.keys.alive, 0, 0, withscores=True)
            beat, fresh = await pipe.execute()
        return beat is None or not fresh or beat < fresh[0][1] - dead_after_ms

    async def takeover(
        self,
        channels: Iterable[str],
        dead: str,
        *,
        dead_after_ms: int | None,
        limit: int = LEASES_LOOKED_AT,
        keep: Collection[str] = (),
    ) -> list[str]:
        """Re-notify, at once, the keys whose lease ``dead`` holds in ``channels`` (its
        liveness beat stopped for ``dead_after_ms``, judged again in the script; None: the
        caller is ``dead`` itself, starting): its leases are deleted so any worker acquires
        them with a new nonce. Reads at most ``limit`` lease-registry members per channel:
        leases are held only while served, so a registry is as large as what workers
        serve, not as what frontends wrote. ``keep``: lease values left alone (the
        caller's own, held now)."""
        done: list[str] = []
        for channel in channels:
            registry = self.keys.leases(channel)
            members = texts(await self.redis.zrange(registry, 0, limit - 1))
            if not members:
                continue
            values = await self.redis.mget([self.keys.lease(k) for k in members])
            held = [
                (k, text(v))
                for k, v in zip(members, values, strict=True)
                if v is not None and text(v).partition("|")[2] == dead and text(v) not in keep
            ]
            silent = "" if dead_after_ms is None else dead_after_ms
            for key, value in held:
                keys = [self.keys.lease(key), registry, self.keys.ready(channel), self.keys.alive]
                args = [value, key, READY_MAXLEN, dead, silent, unified_flag(channel)]
                reply = await self.bus.scripts.call("takeover", keys, args)
                if isinstance(reply, list) and texts(reply)[:1] == ["!unusable"]:
                    await self.bus.repair_ready(channel, texts(reply)[1])
                    break
                if int(reply) == 1:
                    done.append(key)
        return done

    async def forget_dead(self, worker_id: str) -> None:
        """The worker's leases are taken over (or it left): no more liveness entry."""
        await self.redis.zrem(self.keys.alive, worker_id)
