"""A worker process's metrics and health port (``AGENT_METRICS_PORT``) and its one log
line per turn, against a redis-server of the test's own (stopped at the end to see
``/readyz`` fail)."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
import redis.asyncio as aioredis
from helpers import run_cli
from replies import wait_until_async
from servers import RedisServer, free_port, require_redis_server
from workers import WorkerProcess

from bus_redis import FrontendClient, InboundMessage

pytestmark = pytest.mark.real_redis


@pytest.fixture
def server() -> Iterator[RedisServer]:
    require_redis_server()
    srv = RedisServer().start()
    yield srv
    srv.cleanup()


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _value(metrics: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", metrics, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


async def test_metrics_health_and_a_line_per_turn(server: RedisServer) -> None:
    port = free_port()
    worker = WorkerProcess(
        server.url,
        worker_id="observed",
        env={"AGENT_PROVIDER": "echo", "AGENT_CHANNELS": "web", "AGENT_METRICS_PORT": str(port)},
    )
    base = f"http://127.0.0.1:{port}"
    redis = aioredis.from_url(server.url, decode_responses=True)
    try:
        client = FrontendClient(redis)
        for i in range(3):
            msg = InboundMessage(channel="web", sender_id="u", chat_id="c", content=f"hi {i}")
            assert (await client.ask(msg, timeout_s=20)).type == "message"
        events = client.events(["web:bad"], after="0-0")
        await client.send_raw("web:bad", "{not json")
        assert (await asyncio.wait_for(anext(events), 20)).code == "invalid_message"
        key, _ = await client.open_transient("web", "p")
        private = InboundMessage(
            channel="web", sender_id="u", chat_id="p", content="SECRET-PRIVATE-TEXT",
            session_key_override=key, require_existing_session=True,
        )  # fmt: skip
        assert (await client.ask(private, timeout_s=20)).type == "message"

        status, body = await asyncio.to_thread(_get, f"{base}/metrics")
        assert status == 200
        assert _value(body, 'agent_turns_total{outcome="message"}') == 5  # 3 + open + private
        assert _value(body, 'agent_turns_total{outcome="invalid_message"}') == 1
        assert _value(body, 'agent_dead_letters_total{reason="invalid_message"}') == 1
        assert _value(body, "agent_provider_requests_total") == 4
        assert _value(body, "agent_turn_seconds_count") == 6
        assert _value(body, "agent_turns_in_flight") == 0
        assert "web:c" not in body  # no session, chat or message id as a label
        assert await asyncio.to_thread(_get, f"{base}/livez") == (200, "ok\n")
        assert await asyncio.to_thread(_get, f"{base}/readyz") == (200, "ready\n")
        assert (await asyncio.to_thread(_get, f"{base}/nope"))[0] == 404

        log = worker.log()
        assert re.search(
            r"turn of web:c message \w+ \(entry [0-9-]+\): outcome message, \d+ ms, tokens 0\+0",
            log,
        )
        assert "outcome message" in log
        assert "turn of a private session: " in log
        assert "SECRET-PRIVATE-TEXT" not in log

        await redis.aclose()
        server.stop(kill=True)

        async def not_ready() -> bool:
            return (await asyncio.to_thread(_get, f"{base}/readyz"))[0] == 503

        assert await wait_until_async(not_ready, timeout_s=10)
        assert (await asyncio.to_thread(_get, f"{base}/livez"))[0] == 200
    finally:
        print(worker.log()[-3000:])
        worker.close()


def _status(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return run_cli("status", "--redis-url", url, *args)  # type: ignore[no-any-return]


async def test_status_check_sees_no_worker_a_live_one_and_a_killed_one(server: RedisServer) -> None:
    none = await asyncio.to_thread(_status, server.url, "--check")
    assert none.returncode == 1
    assert none.stdout.startswith("unhealthy: no worker alive")
    worker = WorkerProcess(
        server.url,
        worker_id="checked",
        env={"AGENT_PROVIDER": "echo", "AGENT_CHANNELS": "web", "AGENT_LOCK_TTL_MS": "1500"},
    )
    redis = aioredis.from_url(server.url, decode_responses=True)
    try:
        msg = InboundMessage(channel="web", sender_id="u", chat_id="c", content="hi")
        assert (await FrontendClient(redis).ask(msg, timeout_s=20)).type == "message"
        live = await asyncio.to_thread(_status, server.url, "--check")
        assert (live.returncode, live.stdout.strip()) == (0, "healthy: 1 workers alive")
        report = json.loads((await asyncio.to_thread(_status, server.url, "--json")).stdout)
        (w,) = report["workers"]
        assert w["alive"] is True
        assert isinstance(w["pid"], int)
        assert isinstance(report["channels"]["web"]["ready"], int)

        worker.kill()

        async def dead() -> bool:
            res = await asyncio.to_thread(_status, server.url, "--check")
            return res.returncode == 1 and "no worker alive" in res.stdout

        assert await wait_until_async(dead, timeout_s=15)  # its own TTL: 1.5 s
        text = (await asyncio.to_thread(_status, server.url)).stdout
        assert "checked  dead" in text
    finally:
        await redis.aclose()
        worker.close()


async def test_status_names_each_leases_holder(server: RedisServer) -> None:
    from bus_redis import RedisBus

    redis = aioredis.from_url(server.url, decode_responses=True)
    try:
        await redis.sadd("agent:channels", "web")
        bus = RedisBus(redis)
        await FrontendClient(redis).send(
            InboundMessage(channel="web", sender_id="u", chat_id="held", content="x")
        )
        got = await bus.acquire("web:held", "w-holder", member="web:held", select=False)
        assert got is not None
        report = json.loads((await asyncio.to_thread(_status, server.url, "--json")).stdout)
        assert [(lease["key"], lease["holder"]) for lease in report["active_leases"]] == [
            ("web:held", "w-holder")
        ]
    finally:
        await redis.aclose()


async def test_json_logs_and_sigterm_said_as_it_is(server: RedisServer) -> None:
    import signal

    worker = WorkerProcess(
        server.url,
        worker_id="jsonlog",
        env={"AGENT_PROVIDER": "echo", "AGENT_CHANNELS": "web", "AGENT_LOG_FORMAT": "json"},
    )
    redis = aioredis.from_url(server.url, decode_responses=True)
    try:
        msg = InboundMessage(channel="web", sender_id="u", chat_id="j", content="hi")
        assert (await FrontendClient(redis).ask(msg, timeout_s=20)).type == "message"
        worker.signal(signal.SIGTERM)
        assert await asyncio.to_thread(worker.proc.wait, 20) == 0
        lines = [json.loads(line) for line in worker.log().splitlines() if line.strip()]
        messages = [d["msg"] for d in lines]
        assert all({"ts", "level", "logger", "msg"} <= d.keys() for d in lines)
        assert any(m.startswith("turn of web:j message ") for m in messages)
        assert any(m.startswith("SIGTERM: taking no new work") for m in messages)
        assert not any("SIGUSR1" in m for m in messages)
    finally:
        await redis.aclose()
        worker.close()
