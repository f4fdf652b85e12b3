"""Checks a worker makes before it serves: a Redis that keeps what it is given, no live
twin with its id, one folding mode.

An evicting ``maxmemory-policy`` drops keys under memory pressure: a lease (fencing
gone), a queued message, a row of someone's history; workers refuse it. Two processes
with one worker id would share an inbox and owner records (private sessions would fail
at random); workers that disagree on unified mode would split one chat's history between
two sessions. All are operator mistakes: refuse to start, with one line that says why.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterable

from bus_redis import RedisBus
from bus_redis.codec import fresh_nonce, server_ms, text, texts
from bus_redis.registry import Registry, lost_event

log = logging.getLogger(__name__)
SAFE_POLICIES = frozenset({"noeviction"})


class WorkerConflictError(RuntimeError):
    """This worker must not start next to the ones already serving."""


async def redis_info(bus: RedisBus, section: str) -> dict[str, str]:
    """One INFO section as text (empty when the server does not say: fakeredis)."""
    try:
        info = await bus.redis.info(section)
    except Exception:
        return {}
    return {str(k): text(v) for k, v in info.items()}


async def eviction_policy(bus: RedisBus) -> str | None:
    """The server's ``maxmemory-policy`` when it evicts keys, else None."""
    policy = (await redis_info(bus, "memory")).get("maxmemory_policy", "noeviction")
    return None if policy in SAFE_POLICIES else policy


async def check_redis(bus: RedisBus) -> None:
    """Refuse an evicting Redis; warn when it keeps nothing across a restart."""
    policy = await eviction_policy(bus)
    if policy is not None:
        raise WorkerConflictError(
            f"Redis evicts keys (maxmemory-policy {policy}): leases, queued messages and "
            f"history could vanish; set maxmemory-policy noeviction (CONFIG SET or redis.conf)"
        )
    persistence = await redis_info(bus, "persistence")
    if persistence.get("aof_enabled") == "0":
        log.warning(
            "Redis has appendonly off: a Redis restart loses what was written since its last "
            "snapshot (queued messages, history); set appendonly yes for production"
        )


def _in_use(worker_id: str, host: str | None, pid: str | None) -> WorkerConflictError:
    return WorkerConflictError(
        f"worker id {worker_id!r} is in use by pid {pid} on {host}: give each worker its "
        f"own AGENT_WORKER_ID"
    )


def id_taken(worker_id: str, host: str, pid: str) -> WorkerConflictError:
    """Another process claimed this worker's id while this one was stopped (SIGSTOP past
    its record): found by its heartbeat (``heartbeat.lua``), it stopped serving."""
    return WorkerConflictError(
        f"worker id {worker_id!r} was claimed by pid {pid} on {host} while this process was "
        "stopped; it stopped serving: give each worker its own AGENT_WORKER_ID"
    )


def _pid_alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def mode_of(*, unified: bool, single_owner: bool) -> str:
    """The deployment's mode, as ``P:mode`` holds it: every worker on a Redis the same."""
    return "unified" if unified else "single-owner" if single_owner else "per-session"


async def check_can_serve(
    bus: RedisBus, worker_id: str, *, unified: bool, single_owner: bool = False
) -> str:
    """Refuses (``WorkerConflictError``) a start beside a live worker of this id or of
    another mode; else claims the id: the claim returned is what this process's
    heartbeats check (``heartbeat.lua``)."""
    await check_redis(bus)
    info = {
        text(k): text(v)
        for k, v in (await bus.redis.hgetall(bus.keys.worker_info(worker_id))).items()  # type: ignore[misc]
    }
    seen = await bus.redis.zscore(bus.keys.workers, worker_id)
    now_ms = await server_ms(bus.redis)  # heartbeats are stamped with Redis's clock
    alive = seen is not None and now_ms - float(seen) < 3 * bus.lock_ttl_ms
    me = (socket.gethostname(), str(os.getpid()))
    if alive and info and info.get("host") == me[0] and not _pid_alive(info.get("pid", "")):
        alive = False  # a crashed process of this host: restarting under its id is fine
    if alive and info and (info.get("host"), info.get("pid")) != me:
        raise _in_use(worker_id, info.get("host"), info.get("pid"))
    mode = mode_of(unified=unified, single_owner=single_owner)
    key = bus.keys.mode
    await bus.redis.set(key, mode, nx=True)
    current = text(await bus.redis.get(key))
    if current != mode:
        raise WorkerConflictError(
            f"the workers on this Redis run in {current} mode and this one in {mode} mode "
            f"(AGENT_UNIFIED_SESSION and AGENT_SINGLE_OWNER must be the same for all; "
            f"`DEL {key}` once all are stopped to change it)"
        )
    # the id, last (no record is left behind by a refusal above), taken atomically: a twin
    # started at the same moment read no live record either
    keys = [bus.keys.worker_info(worker_id), bus.keys.workers]
    ttl_ms = 3 * bus.lock_ttl_ms
    claim = fresh_nonce()
    args = [worker_id, info.get("claim", ""), claim, *me, ttl_ms, now_ms]
    claimed = await bus.scripts.call("claim", keys, args)
    if claimed != 1:
        host, pid = texts(claimed)
        raise _in_use(worker_id, host, pid)
    return claim


async def end_former_private(
    registry: Registry, worker_id: str, channels: Iterable[str], abandoned: set[str]
) -> None:
    """A start under an id a killed worker had: that former life's private sessions end
    now, as at a shutdown (the record dropped, the frontend told ``session_lost``). Their
    records name this id, so they would never look dead, and this life would serve their
    keys as its own: a durable answer on the key, then the loss report when the record
    ran out deleting it with the private session's events (a helper's attack, stop 51).
    ``abandoned`` (the start's own, kept across its retries): registry members whose
    record was dropped and whose loss is not told yet; a retried start finds them there,
    their records gone (a second reading, stop 52)."""
    for key, member in await registry.owned_by(worker_id, channels):
        await registry.abandon_owner(key, worker_id)
        abandoned.add(member)
    for member in sorted(abandoned):
        await registry.report_owner_lost(member, lost_event(member))
        abandoned.discard(member)
