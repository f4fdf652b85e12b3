"""What a dead worker or a changed Redis server leaves behind, from a second reading of
the failover fixes: a dead worker's subagent run again once (not by every survivor), and
also when its worker was gone longer than the liveness watch remembers; a server change
seen after a refused INFO (without the multiplexed connection: in
test_restarts_and_stalls.py). Each test failed on the
code before its fix."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import redis.asyncio as aioredis
from helpers import ScriptedProvider
from redis.exceptions import ConnectionError as RedisConnectionError
from replies import until

from bus_redis import Keys
from worker.agent.providers import LLMResponse
from worker.jobs.local import LocalJobQueue

K = Keys()


# --- 3. subagents of a dead worker ------------------------------------------------------
class _SubModel:
    """A subagent's model call (prompt starts with "Task") waits for ``release``; counts
    the calls of each task and how many run at once."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.started = 0
        self.running = 0
        self.most = 0

    async def __call__(self, **kw: Any) -> LLMResponse:
        last = kw["messages"][-1]
        if last["role"] == "user" and str(last["content"]).startswith("Task"):
            self.started += 1
            self.running += 1
            self.most = max(self.most, self.running)
            try:
                await self.release.wait()
            finally:
                self.running -= 1
            return LLMResponse(content="found: 42")
        return LLMResponse(content="ok")


async def test_two_survivors_rerun_a_dead_workers_subagent_only_once(redis) -> None:  # type: ignore[no-untyped-def]
    """Worker ``wd`` died while its subagent ran. Every survivor watches liveness every
    ``liveness_ms / 8`` (100 ms) and each one that judges ``wd`` dead calls
    ``Subagents.rerun_orphans`` for its channels: nothing claims the orphan (the
    registration still names ``wd`` until a re-run marks itself ``running``), so two
    survivors that look within that window both start it again (with arq: the second
    one deletes the in-progress key of the first re-run, whose poll delay alone is
    200 ms). The subagent then runs twice at once (its model calls paid twice)."""
    from bus_redis import RedisBus
    from worker import AgentLoop, LoopConfig

    model = _SubModel()
    survivors = [
        AgentLoop(RedisBus(redis), ScriptedProvider(handler=model), config=LoopConfig(worker_id=w))
        for w in ("wa", "wb")
    ]
    store = survivors[0].subagents.store
    await redis.set(K.lease("web:d"), "n|wd", px=10_000)
    doc = {"id": "s1", "session": "web:d", "channel": "web", "chat_id": "d", "scope": "web/u",
           "label": "s1", "task": "look it up", "after": "1-0", "state": "queued"}  # fmt: skip
    assert await store.add("web:d", "n|wd", "web:d", "s1", json.dumps(doc), limit=3,
                           channel_limit=8, scope="web/u", scope_limit=2) == 1  # fmt: skip
    doc |= {"state": "running", "worker": "wd"}  # as wd's run_job recorded it
    assert await store.running("web:d", "s1", json.dumps(doc))
    try:
        # both survivors judge wd dead in the same watch period
        await asyncio.gather(*(s.subagents.rerun_orphans("wd", {"web"}) for s in survivors))

        def live_jobs() -> int:
            return sum(1 for s in survivors for t in s.rt.jobs._running.values() if not t.done())

        # settled: every job still alive waits in the model (the others returned)
        await until(lambda: model.started >= 1 and live_jobs() == model.running, timeout_s=10)
        assert model.most == 1, (
            f"the dead worker's subagent runs {model.most} times at once after two "
            f"survivors judged it dead"
        )
    finally:
        model.release.set()
        for s in survivors:
            await s.rt.jobs.aclose()


# --- 2. a Redis that comes back as another server ---------------------------------------
class _FakeRedis:
    """A RESP server whose ``INFO`` answer is given per connection (``infos``, in order);
    PING answers PONG. Closing ``drop()`` ends the current connection."""

    def __init__(self, infos: list[bytes]) -> None:
        self.infos = infos
        self.conns = 0
        self.writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        info = self.infos[min(self.conns, len(self.infos) - 1)]
        self.conns += 1
        self.writers.append(writer)
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                if not line.startswith(b"*"):
                    continue
                args = []
                for _ in range(int(line[1:])):
                    n = int((await reader.readline())[1:])
                    args.append((await reader.readexactly(n + 2))[:-2])
                cmd = args[0].upper()
                if cmd == b"INFO":
                    writer.write(info)
                elif cmd == b"PING":
                    writer.write(b"+PONG\r\n")
                else:
                    writer.write(b"+OK\r\n")
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            return

    def drop(self) -> None:
        for w in self.writers:
            w.close()
        self.writers.clear()

    def close(self) -> None:
        self.drop()
        if self.server is not None:
            self.server.close()


def _info(run_id: str) -> bytes:
    body = f"# Server\r\nredis_version:7.2.0\r\nrun_id:{run_id}\r\n".encode()
    return b"$%d\r\n%s\r\n" % (len(body), body)


async def test_a_connect_whose_info_was_refused_does_not_blind_the_next_server_change() -> None:
    """``Multiplexed._handshake`` sets ``self._server = ""`` when INFO answers an error
    (a NOPERM while an operator reloads ACLs, a BUSY script, a proxy): it also calls
    ``on_new_server`` for that (same) server, and then the *next* connect compares
    against "" (``if self._server and ...``): the first real change of server after it
    (a restart from an older snapshot) is taken as the first connect and drops nothing,
    so the worker keeps copies the new server contradicts."""
    from bus_redis.mux import Multiplexed
    from bus_redis.server_watch import ServerWatch

    fake = _FakeRedis([_info("A" * 40), b"-NOPERM no INFO for you\r\n", _info("B" * 40)])
    port = await fake.start()
    mux = Multiplexed(host="127.0.0.1", port=port)
    told: list[int] = []
    mux.server_watch = ServerWatch(lambda: told.append(fake.conns))
    try:
        for conn in (1, 2, 3):  # server A; A again (INFO refused); then server B
            await until(lambda: _pinged(mux), timeout_s=10)
            assert fake.conns == conn
            fake.drop()
            await until(lambda: mux._link is None or not mux._link.usable, timeout_s=10)
        assert 3 in told, f"on_new_server called at connects {told}: not when the server became B"
    finally:
        await mux.aclose()
        fake.close()


async def _pinged(mux: Any) -> bool:
    from redis.exceptions import ConnectionError as RedisConnectionError

    try:
        return await mux.execute("PING") in (b"PONG", "PONG")
    except RedisConnectionError:
        return False


async def _dead_worker_left(redis: Any, *, silent_ms: int) -> tuple[Any, _SubModel, Any]:
    """A survivor ``wa`` (not running: its liveness watch is driven by the test), and
    worker ``wd`` whose beat is ``silent_ms`` older than ``wa``'s, with a subagent
    registered as running on it."""
    import time

    from bus_redis import RedisBus
    from worker import AgentLoop, LoopConfig
    from worker.runtime.liveness import Liveness

    model = _SubModel()
    wa = AgentLoop(
        RedisBus(redis),
        ScriptedProvider(handler=model),
        config=LoopConfig(worker_id="wa", liveness_ms=800),
    )
    store = wa.subagents.store
    await redis.set(K.lease("web:d"), "n|wd", px=10_000)
    doc = {"id": "s1", "session": "web:d", "channel": "web", "chat_id": "d", "scope": "web/u",
           "label": "s1", "task": "look it up", "after": "1-0", "state": "queued"}  # fmt: skip
    assert await store.add("web:d", "n|wd", "web:d", "s1", json.dumps(doc), limit=3,
                           channel_limit=8, scope="web/u", scope_limit=2) == 1  # fmt: skip
    doc |= {"state": "running", "worker": "wd"}
    assert await store.running("web:d", "s1", json.dumps(doc))
    await redis.delete(K.lease("web:d"))  # (its lease ran out meanwhile)
    now_ms = await wa.rt.registry.sweeps.beat("wa")
    await redis.zadd(K.alive, {"wd": now_ms - silent_ms})
    await redis.zadd(K.workers, {"wd": now_ms - silent_ms})  # its heartbeat, as old
    watch = Liveness(
        wa.rt,
        liveness_ms=800,
        channels=lambda: {"web"},
        streams=lambda: [],
        dispatch=lambda notes: None,
        on_dead=wa.subagents.rerun_orphans,
    )
    watch.beat_ok_at = time.monotonic()  # its own beats land, and have for a while
    watch.beat_ok_since = time.monotonic() - 3600
    return wa, model, watch


async def test_a_subagent_of_a_worker_silent_for_over_a_minute_runs_again(redis) -> None:  # type: ignore[no-untyped-def]
    """The only worker was killed while its subagent ran and comes back (a new process,
    a new id) 2 minutes later, or the survivors were down as long. ``lua/dead.lua``
    forgets beats older than ``forget_after_ms`` = max(6 TTL, 10 liveness) = 60 s against
    the freshest beat *before* it returns the dead ones, so ``wd`` is never judged dead
    and ``on_dead`` (``rerun_orphans``) is never called: the subagent's registration
    (TTL 1 h, and a slot of the session's and of the channel's bound) says ``running``
    on a worker that is gone; a local job never runs again and an arq job waits out its
    in-progress key (15 min), the delay d8ac5fa removed for the other cases. (With
    ``wd`` silent 5 s instead, the same watch re-runs it.) The maintenance tick that
    prunes a worker gone that long (its heartbeat) runs it again."""
    wa, model, watch = await _dead_worker_left(redis, silent_ms=120_000)
    try:
        await watch.watch_once()
        wa.maintenance.channels = {"web"}
        await wa.maintenance._prune_workers()  # a tick's step, on any worker

        async def ran() -> bool:
            return model.started >= 1

        try:
            await until(ran, timeout_s=10)
        except AssertionError:
            raise AssertionError(
                "the subagent registered as running on a worker that is gone did not run again"
            ) from None
        assert model.started == 1
    finally:
        model.release.set()
        await wa.rt.jobs.aclose()


# --- 4. a claimed job that could not be queued again -----------------------------------
class _RefusingJobs(LocalJobQueue):
    """A job queue whose ``orphaned`` fails ``fail`` times (Redis refusing it)."""

    def __init__(self, fail: int) -> None:
        super().__init__()
        self.fail = fail
        self.orphans: list[str] = []

    async def orphaned(self, name: str, *, job_id: str, **kwargs: Any) -> None:
        if self.fail:
            self.fail -= 1
            raise RedisConnectionError("refused")
        self.orphans.append(job_id)


async def test_a_claimed_job_that_could_not_be_queued_again_is_claimed_again_later(
    redis: aioredis.Redis,
) -> None:
    """A survivor claims a dead worker's running jobs (each entry once among all
    survivors) and then queues them again. When queueing fails (Redis refusing it), the
    claimed entries go back, so that the next look at the dead worker (the prune of its
    record) queues them; before, they waited out the job queue's timeout (15 minutes)."""
    from bus_redis import RedisBus
    from bus_redis.running_jobs import RUNNING_TTL_MS, RunningJobs
    from worker import AgentLoop, LoopConfig

    bus = RedisBus(redis)
    dead = RunningJobs(bus, "w-dead", ttl_ms=60_000)
    await dead.started("j1", "consolidate", "web", {"key": "web:a", "start": 0, "end": 4})
    await dead.started("j2", "consolidate", "web", {"key": "web:b", "start": 2, "end": 6})
    subagents = RunningJobs(bus, "w-dead", ttl_ms=60_000, kind="subagents")
    await subagents.started("j3", "subagent", "web", {"session": "web:c", "sid": "s3"})
    await redis.hset(K.spawned("web:c"), "s3", json.dumps({"state": "queued", "by": "w-x"}))
    jobs = _RefusingJobs(fail=2)
    loop = AgentLoop(bus, ScriptedProvider(), jobs=jobs, config=LoopConfig(worker_id="w1"))
    await loop.leftovers.rerun("w-dead", {"web"})  # both kinds refused once: logged
    assert jobs.orphans == []
    left = await redis.hgetall(K.worker_jobs("w-dead"))
    assert set(left) == {"j1", "j2"}, left
    assert set(await redis.hgetall(K.worker_jobs("w-dead", "subagents"))) == {"j3"}
    assert 0 < await redis.pttl(K.worker_jobs("w-dead")) <= RUNNING_TTL_MS  # (not for ever)
    await loop.leftovers.rerun("w-dead", {"web"})  # the next look
    assert sorted(jobs.orphans) == ["j1", "j2", "j3"]
    assert not await redis.exists(K.worker_jobs("w-dead"))
    assert not await redis.exists(K.worker_jobs("w-dead", "subagents"))
