"""Checks a worker makes before it serves: no live twin with its id, one folding mode.

Two processes with one worker id would share an inbox and owner records (private
sessions would fail at random); workers that disagree on unified mode would split one
chat's history between two sessions. Both are operator mistakes: refuse to start.
"""

from __future__ import annotations

import os
import socket
import time

from bus_redis import RedisBus
from bus_redis.codec import text


class WorkerConflictError(RuntimeError):
    """This worker must not start next to the ones already serving."""


def _pid_alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


async def check_can_serve(
    bus: RedisBus, worker_id: str, *, unified: bool, single_owner: bool = False
) -> None:
    info = {
        text(k): text(v)
        for k, v in (await bus.redis.hgetall(bus.keys.worker_info(worker_id))).items()  # type: ignore[misc]
    }
    seen = await bus.redis.zscore(bus.keys.workers, worker_id)
    alive = seen is not None and time.time() * 1000 - float(seen) < 3 * bus.lock_ttl_ms
    me = (socket.gethostname(), str(os.getpid()))
    if alive and info and info.get("host") == me[0] and not _pid_alive(info.get("pid", "")):
        alive = False  # a crashed process of this host: restarting under its id is fine
    if alive and info and (info.get("host"), info.get("pid")) != me:
        raise WorkerConflictError(
            f"worker id {worker_id!r} is in use by pid {info.get('pid')} on "
            f"{info.get('host')}: give each worker its own AGENT_WORKER_ID"
        )
    mode = "unified" if unified else "single-owner" if single_owner else "per-session"
    key = f"{bus.keys.prefix}:mode"
    await bus.redis.set(key, mode, nx=True)
    current = text(await bus.redis.get(key))
    if current != mode:
        raise WorkerConflictError(
            f"the workers on this Redis run in {current} mode and this one in {mode} mode "
            f"(AGENT_UNIFIED_SESSION and AGENT_SINGLE_OWNER must be the same for all; "
            f"`DEL {key}` once all are stopped to change it)"
        )
