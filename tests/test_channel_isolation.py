"""No channel can stall another (issue 12), on a real redis-server under the generated
ACLs with real worker processes: ``web`` is a hostile frontend (or a gateway forwarding
every click), ``telegram`` an honest one. Scaled down from the reproductions; each test
asserts behaviour (answered / not answered, kept / gone), never timings (the figures are
in ``bench/isolation.py``).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import pytest
import redis.asyncio as aioredis
from fake_llm import FakeLLM
from replies import wait_until_async
from servers import RedisServer, require_redis_server
from workers import WorkerProcess

from bus_redis import FrontendClient, InboundMessage, Keys
from bus_redis.acl import frontend_acl, worker_acl

pytestmark = pytest.mark.real_redis
PW = "s3cret-pw-iso"
K = Keys()
FAST = {  # short periods so that recovery shows within a test's patience
    "AGENT_FOLLOWUP_MODE": "queue",  # an answer per message (the tests count them)
    "AGENT_LOCK_TTL_MS": "3000",
    "AGENT_SWEEP_INTERVAL_MS": "500",
    "AGENT_CHANNELS": "web,telegram",
    "AGENT_HISTORY_TOKENS": "200",  # short prompts: the long-queue test runs 300 turns
}


@dataclass
class Deployment:
    server: RedisServer
    llm: FakeLLM
    workers: list[WorkerProcess]

    def url(self, user: str) -> str:
        return self.server.url.replace("redis://", f"redis://{user}:{PW}@")


@pytest.fixture(scope="module")
def deployment() -> Iterator[Deployment]:
    require_redis_server()
    server = RedisServer().start()
    llm = FakeLLM().start()
    lines = [*frontend_acl("web", PW), *frontend_acl("telegram", PW), *worker_acl(PW)]
    subprocess.run(
        ["redis-cli", "-p", str(server.port)],
        input="\n".join(lines) + "\n",
        text=True,
        check=True,
        capture_output=True,
    )
    dep = Deployment(server, llm, [])
    env = {
        **FAST,
        "AGENT_PROVIDER": "openai",
        "AGENT_MODEL": "fake-model",
        "OPENAI_BASE_URL": llm.base_url,
        "OPENAI_API_KEY": "test",
    }
    dep.workers = [
        WorkerProcess(dep.url("agent-worker"), worker_id=f"iso{i}", env=env) for i in range(2)
    ]
    yield dep
    for w in dep.workers:
        print(f"----- log of worker {w.worker_id} -----\n{w.log()[-3000:]}")
        w.close()
    llm.stop()
    server.cleanup()


@pytest.fixture
async def clients(deployment: Deployment) -> AsyncIterator[tuple[aioredis.Redis, aioredis.Redis]]:
    web = aioredis.from_url(deployment.url("frontend-web"), decode_responses=True)
    telegram = aioredis.from_url(deployment.url("frontend-telegram"), decode_responses=True)
    yield web, telegram
    await web.aclose()
    await telegram.aclose()


def _msg(channel: str, chat: str, text: str, **kw: object) -> InboundMessage:
    return InboundMessage(channel=channel, sender_id="u", chat_id=chat, content=text, **kw)  # type: ignore[arg-type]


async def _answered(redis: aioredis.Redis, channel: str, text: str, timeout_s: float = 20) -> str:
    chat = uuid.uuid4().hex[:8]
    ev = await FrontendClient(redis).ask(_msg(channel, chat, text), timeout_s=timeout_s)
    return ev.content or ev.code or ""


async def test_markers_queued_at_a_head_are_consumed_in_steps_and_nobody_waits(
    clients: tuple[aioredis.Redis, aioredis.Redis],
) -> None:
    """Point 1: thousands of stop markers at the head of one web session."""
    web, telegram = clients
    session = "web:markers"
    async with web.pipeline(transaction=False) as pipe:
        for _ in range(20_000):
            pipe.xadd(K.inbound(session), {"control": "stop"})
            pipe.incr(K.control_hint(session))
        await pipe.execute()
    after = FrontendClient(web).ask(_msg("web", "markers", "after the markers"), timeout_s=60)
    assert await _answered(telegram, "telegram", "hello") == "re: hello"
    assert (await after).content == "re: after the markers"  # the marker covered nothing after


async def test_a_hint_set_again_and_again_over_a_long_queue_costs_one_read_per_entry(
    clients: tuple[aioredis.Redis, aioredis.Redis],
) -> None:
    """Point 2: a long queue and a hint re-set with every message; the queue is answered in
    order, nothing is taken for stopped, and telegram is served meanwhile."""
    web, telegram = clients
    session = "web:longq"
    client = FrontendClient(web)
    ids = []
    async with web.pipeline(transaction=False) as pipe:
        for i in range(300):
            msg = _msg("web", "longq", f"q{i}", id=f"q{i}")
            ids.append(msg.id)
            pipe.xadd(K.inbound(session), {"payload": msg.model_dump_json(exclude_none=True)})
            pipe.incrby(K.control_hint(session), 1000)
        pipe.xadd(K.ready("web"), {"session": session})
        await pipe.execute()
    assert await _answered(telegram, "telegram", "still here") == "re: still here"
    events = client.events([session], after="0")

    async def last_answered() -> list[str]:
        seen: list[str] = []
        async for ev in events:
            if ev.is_terminal:
                seen.append(ev.content or ev.code or "")
            if len(seen) == len(ids):
                return seen
        return seen

    seen = await asyncio.wait_for(last_answered(), 120)
    assert seen == [f"re: q{i}" for i in range(300)]


async def test_a_ready_queue_at_the_maximal_id_stops_no_other_channels_recovery(
    deployment: Deployment, clients: tuple[aioredis.Redis, aioredis.Redis]
) -> None:
    """Point 3: web's ready queue can take no entry; a telegram message whose notification
    was lost is still answered by the sweep, and web's own queue is repaired."""
    web, telegram = clients
    await web.xadd(
        K.ready("web"), {"session": "web:x"}, id="18446744073709551615-18446744073709551615"
    )
    lost = _msg("telegram", "lost", "my notification was lost")
    async with telegram.pipeline(transaction=True) as pipe:  # publish without the notification
        pipe.xadd(K.inbound(lost.session_key), {"payload": lost.model_dump_json(exclude_none=True)})
        pipe.zadd(K.queued("telegram"), {lost.session_key: 0}, nx=True)
        await pipe.execute()
    events = FrontendClient(telegram).events([lost.session_key], after="0")
    first = await asyncio.wait_for(anext(events), 30)
    assert first.content == "re: my notification was lost"

    async def web_served() -> bool:
        try:
            return await _answered(web, "web", "repaired?", timeout_s=3) == "re: repaired?"
        except Exception:
            return False

    assert await wait_until_async(web_served, timeout_s=30)


async def test_cheap_junk_keys_neither_dilute_recovery_nor_stay(
    deployment: Deployment, clients: tuple[aioredis.Redis, aioredis.Redis]
) -> None:
    """Point 4: thousands of empty streams, hints and index members written by web;
    stranded telegram messages are answered; web's index members naming telegram sessions
    are never acted on; the empty streams and hints are cleaned up."""
    web, telegram = clients
    n = 1_500  # (more than one janitor step: it visits 1,000 keys a step)
    async with web.pipeline(transaction=False) as pipe:
        for i in range(n):
            pipe.xadd(K.inbound(f"web:junk{i}"), {"x": "1"}, maxlen=0)  # an empty stream
            pipe.incr(K.control_hint(f"web:hint{i}"))
            pipe.zadd(K.queued("web"), {f"web:none{i}": 0})
        pipe.zadd(K.queued("web"), {"telegram:victim": 0})
        await pipe.execute()
    stranded = [_msg("telegram", f"s{i}", f"stranded {i}") for i in range(5)]
    async with telegram.pipeline(transaction=True) as pipe:
        for m in stranded:
            pipe.xadd(K.inbound(m.session_key), {"payload": m.model_dump_json(exclude_none=True)})
            pipe.zadd(K.queued("telegram"), {m.session_key: 0}, nx=True)
        await pipe.execute()
    client = FrontendClient(telegram)
    for m in stranded:
        ev = await asyncio.wait_for(anext(client.events([m.session_key], after="0")), 30)
        assert ev.content == f"re: {m.content}"
    admin = aioredis.from_url(deployment.server.url, decode_responses=True)
    try:

        async def cleaned() -> bool:
            left = [k async for k in admin.scan_iter(match="agent:{web}:in:web:junk*", count=1000)]
            hints = [k async for k in admin.scan_iter(match="agent:{web}:ctl:*", count=1000)]
            return not left and not hints and await admin.zcard(K.queued("web")) == 0

        assert await wait_until_async(cleaned, timeout_s=90)
        assert not await admin.exists(K.inbound("telegram:victim"))  # never notified
    finally:
        await admin.aclose()


async def test_a_control_flood_costs_nothing_to_another_channels_stop(
    deployment: Deployment, clients: tuple[aioredis.Redis, aioredis.Redis]
) -> None:
    """Point 5: web floods its control channel (for its sessions and for made-up ones)
    while a telegram turn is blocked in the model; telegram's stop still cancels it, and
    the workers stay up."""
    web, telegram = clients
    deployment.llm.rearm()
    client = FrontendClient(telegram)
    blocked = asyncio.create_task(client.ask(_msg("telegram", "blocked", "block me"), timeout_s=60))
    assert await asyncio.to_thread(deployment.llm.started.wait, 20)
    flood = json.dumps({"v": 2, "op": "stop", "session_key": "web:x"})

    async def flood_controls() -> None:
        for round_ in range(20):
            async with web.pipeline(transaction=False) as pipe:
                for i in range(2_000):
                    body = flood if i % 2 else flood.replace("web:x", f"web:f{round_}-{i}")
                    pipe.publish(K.control("web"), body)
                await pipe.execute()

    flooding = asyncio.create_task(flood_controls())
    await client.stop("telegram:blocked")
    ev = await blocked
    assert ev.code == "cancelled"
    await flooding
    deployment.llm.release()
    assert all(w.proc.poll() is None for w in deployment.workers)
    assert await _answered(telegram, "telegram", "after the flood") == "re: after the flood"


def _run_worker(
    url: str, env: dict[str, str], *, timeout_s: float
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "worker.cli.main", "run"],
        env={**__import__("os").environ, "AGENT_REDIS_URL": url, **env},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def test_a_worker_refuses_an_evicting_redis() -> None:
    """Point 7: with maxmemory-policy allkeys-lru a worker exits with one clear line."""
    require_redis_server()
    server = RedisServer(extra=["--maxmemory-policy", "allkeys-lru"]).start()
    try:
        done = _run_worker(server.url, {"AGENT_PROVIDER": "echo"}, timeout_s=30)
    finally:
        server.cleanup()
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert "maxmemory-policy allkeys-lru" in last
    assert "noeviction" in last


async def test_a_worker_waits_for_a_connection_instead_of_exiting(deployment: Deployment) -> None:
    """Point 6: a Redis at maxclients makes a starting worker retry, not exit; it serves
    once a connection is free. (Capping connections per frontend is the operator's job:
    docs/SECURITY.md.)"""
    server = RedisServer(extra=["--maxclients", "12"]).start()
    hogs = [aioredis.from_url(server.url) for _ in range(12)]
    try:
        for h in hogs:
            await h.ping()
        worker = WorkerProcess(
            server.url,
            worker_id="patient",
            env={"AGENT_PROVIDER": "echo", "AGENT_CHANNELS": "telegram"},
        )
        try:
            assert await wait_until_async(
                lambda: _true("cannot reach Redis" in worker.log()), timeout_s=20
            )
            assert worker.proc.poll() is None  # still trying
            assert "appendonly off" not in worker.log()
            for h in hogs:
                await h.aclose()
            admin = aioredis.from_url(server.url, decode_responses=True)
            await admin.sadd("agent:channels", "telegram")
            ev = await FrontendClient(admin).ask(_msg("telegram", "p", "finally"), timeout_s=30)
            assert ev.content == "finally" or "finally" in (ev.content or "")
            assert "appendonly off" in worker.log()  # the persistence warning
            await admin.aclose()
        finally:
            print(worker.log()[-2000:])
            worker.close()
    finally:
        server.cleanup()


async def _true(value: bool) -> bool:
    return value


async def test_private_text_is_gone_once_read_or_discarded(
    deployment: Deployment, clients: tuple[aioredis.Redis, aioredis.Redis]
) -> None:
    """Point 8: a private session's text leaves no trace in any key (DUMP) or in an RDB
    snapshot once it was read and deleted, or discarded; its malformed payloads are
    dead-lettered without text by whichever worker reads them."""
    web, _ = clients
    client = FrontendClient(web)
    key, _ = await client.open_transient("web", "priv")
    for i in range(3):
        ev = await client.ask(
            _msg(
                "web",
                "priv",
                f"secret-{i}-XYZZY",
                session_key_override=key,
                require_existing_session=True,
            ),
            timeout_s=20,
        )
        assert ev.content == f"re: secret-{i}-XYZZY"
    admin = aioredis.from_url(deployment.server.url)
    try:
        # read and deleted by ask(): the earlier turns' text is gone from every value
        dump = await _dump_bytes(admin)
        assert b"secret-0-XYZZY" not in dump
        assert b"secret-1-XYZZY" not in dump
        # an answer read but not deleted (a reader that never deletes), then a malformed
        # payload for it (truncated JSON) and a discard
        unread = _msg(
            "web", "priv", "secret-3-XYZZY", session_key_override=key, require_existing_session=True
        )
        after = (await admin.xrevrange(K.out(key), count=1) or [(b"0-0", {})])[0][0]
        await client.send(unread)
        reply = await asyncio.wait_for(anext(client.events([key], after=after.decode())), 20)
        assert reply.content == "re: secret-3-XYZZY"
        await client.send_raw(
            key, '{"v":2,"require_existing_session":true,"content":"secret-9-XYZZY"'
        )
        await client.discard(key)

        async def gone() -> bool:
            return b"XYZZY" not in await _dump_bytes(admin)

        assert await wait_until_async(gone, timeout_s=30)
        dead = await admin.xrange(K.dead("web"))
        assert dead  # the malformed payload was dead-lettered
        assert all(b"XYZZY" not in v for _, f in dead for v in f.values())
        await admin.execute_command("SAVE")
        rdb = await asyncio.to_thread((deployment.server.dir / "dump.rdb").read_bytes)
        assert b"XYZZY" not in rdb
    finally:
        await admin.aclose()


async def _dump_bytes(admin: aioredis.Redis) -> bytes:
    """Every key's DUMP (its serialized value as RDB would hold it, deleted entries too)."""
    parts: list[bytes] = []
    async for key in admin.scan_iter(count=1000):
        value = await admin.dump(key)
        if value is not None:
            parts += [key, value]
    return b"\n".join(parts)


async def test_a_payload_too_deep_to_parse_is_answered_to_its_own_id(
    clients: tuple[aioredis.Redis, aioredis.Redis],
) -> None:
    """Point 9: a payload nested 33 deep is rejected with ``reply_to`` = its ``id``."""
    web, _ = clients
    deep: object = "x"
    for _ in range(33):
        deep = {"k": deep}
    body = {"v": 2, "id": "deep-1", "channel": "web", "sender_id": "u", "chat_id": "deep",
            "content": "hi", "metadata": deep}  # fmt: skip
    client = FrontendClient(web)
    events = client.events(["web:deep"], after="0-0")
    await client.send_raw("web:deep", json.dumps(body))
    ev = await asyncio.wait_for(anext(events), 20)
    assert ev.code == "invalid_message"
    assert ev.reply_to == "deep-1"
