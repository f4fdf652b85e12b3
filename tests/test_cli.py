"""The command line fails with one clear line, never a traceback."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from collections.abc import Iterator

import pytest
import redis
from servers import free_port


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run(
        [sys.executable, "-m", "worker.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def _main(*args: str) -> subprocess.CompletedProcess[str]:
    """The same command line run in this process (``worker.cli.main.main``, what the entry
    point calls): for tests of many commands in a row, each of which would otherwise pay
    for an interpreter's start. The tests above run it as a process."""
    from worker.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse's refusals
            code = exc.code if isinstance(exc.code, int) else 1
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def test_bad_configuration_is_one_line() -> None:
    res = _run("status", env={"AGENT_CONCURRENCY": "many"})
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0
    assert "AGENT_CONCURRENCY" in res.stderr
    assert "Traceback" not in res.stderr


def test_unreachable_redis_is_one_line_without_the_password() -> None:
    url = f"redis://app:hunter2-secret@127.0.0.1:{free_port()}/0"
    for command in (["send", "hi", "--timeout", "1"], ["status"]):
        res = _run(*command, "--redis-url", url)
        assert res.returncode == 1, command
        assert "hunter2" not in res.stdout + res.stderr, command
        assert "Traceback" not in res.stderr, command
    assert (
        "cannot reach Redis at redis://app:***@127.0.0.1"
        in _run("send", "x", "--redis-url", url).stderr
    )


def test_a_worker_waits_for_redis_and_stops_on_sigterm() -> None:
    """``run`` retries with backoff (Redis may be starting or out of connections) and
    says so without the password; SIGTERM ends the wait with exit 0."""
    import os
    import signal

    url = f"redis://app:hunter2-secret@127.0.0.1:{free_port()}/0"
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker.cli.main", "run", "--redis-url", url],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "AGENT_LOG_LEVEL": "INFO"},
    )
    assert proc.stdout is not None
    first = proc.stdout.readline()  # blocks until the worker reports the failed attempt
    assert "cannot reach Redis at redis://app:***@127.0.0.1" in first
    assert proc.poll() is None  # still trying
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert "hunter2" not in first + rest
    assert "Traceback" not in rest


def test_a_bad_log_level_is_one_line() -> None:
    res = _run("run", env={"AGENT_LOG_LEVEL": "LOUD"})
    assert res.returncode == 2
    assert res.stderr.strip() == (
        "agent-worker: bad configuration: AGENT_LOG_LEVEL: Value error, must be one of "
        "DEBUG, INFO, WARNING, ERROR, CRITICAL"
    )


def test_acl_prints_the_lines_for_one_channel() -> None:
    res = _run("acl", "frontend", "--channel", "web", "--password", "s3cret-pw")
    assert res.returncode == 0
    setuser, register = res.stdout.strip().splitlines()
    assert setuser.startswith("ACL SETUSER frontend-web reset on >s3cret-pw -@all ")
    assert "~agent:{web}:out:*" in setuser
    assert "eval" not in setuser
    assert register == "SADD agent:channels web"
    bad = _run("acl", "frontend", "--channel", "we:b", "--password", "s3cret-pw")
    assert bad.returncode == 2
    assert "invalid channel name" in bad.stderr


@pytest.mark.real_redis
def test_status_and_sessions_against_a_real_server(redis_server) -> None:  # type: ignore[no-untyped-def]
    res = _main("status", "--redis-url", redis_server.url)
    assert res.returncode == 0, res.stderr
    assert "redis: up" in res.stdout
    url, scope = ("--redis-url", redis_server.url), ("--scope", "web/sender:u1")
    res = _main("memory", "set", "remember the milk", *url, *scope)
    assert res.returncode == 0
    assert _main("memory", "show", *url, *scope).stdout.strip() == "remember the milk"
    empty = _main("memory", "set", *url, *scope)  # no TEXT: refused
    assert empty.returncode == 2
    assert "memory clear" in empty.stderr
    assert _main("memory", "show", *url, *scope).stdout.strip() == "remember the milk"
    # per-session mode (this process's settings, or the workers' mode): a show, set or
    # clear without --scope would read or write unified/owner, a memory no session reads;
    # refused
    for action in (("set", "the owner's fact"), ("clear",), ("show",)):
        unscoped = _main("memory", *action, *url)
        assert unscoped.returncode == 2
        assert "needs --scope" in unscoped.stderr
    sync = redis.Redis.from_url(redis_server.url, decode_responses=True)
    before = sync.get("agent:mode")  # (the session's server: other tests' workers set it)
    try:
        sync.set("agent:mode", "per-session")  # the workers' mode says so too
        assert _main("memory", "clear", *url).returncode == 2
        sync.set("agent:mode", "single-owner")  # one memory: the default scope is it
        assert _main("memory", "set", "the owner's fact", *url).returncode == 0
        assert _main("memory", "show", *url).stdout.strip() == "the owner's fact"
    finally:
        if before is None:
            sync.delete("agent:mode")
        else:
            sync.set("agent:mode", before)
        sync.close()


def test_status_reports_an_outage() -> None:
    res = _run("status", "--redis-url", f"redis://127.0.0.1:{free_port()}/0")
    assert res.returncode == 1
    assert res.stdout.startswith("redis: DOWN")


@pytest.mark.real_redis
def test_dlq_list_show_replay_purge(redis_server) -> None:  # type: ignore[no-untyped-def]
    import json

    import redis as syncredis

    url = redis_server.url
    r = syncredis.Redis.from_url(url, decode_responses=True)
    r.flushall()
    letter = {
        "session": "web:x",
        "entry_id": "1-0",
        "payload": '{"v":2}',
        "reason": "too bad",
        "deliveries": 6,
    }
    entry_id = r.xadd("agent:{web}:dead", {"entry": json.dumps(letter)})

    listed = _main("dlq", "list", "--redis-url", url)
    assert entry_id in listed.stdout
    assert "too bad" in listed.stdout
    assert json.loads(_main("dlq", "show", entry_id, "--redis-url", url).stdout)["deliveries"] == 6
    assert _main("dlq", "replay", entry_id, "--redis-url", url).returncode == 0
    assert r.xlen("agent:{web}:dead") == 0
    assert r.xrange("agent:{web}:in:web:x")[0][1]["payload"] == '{"v":2}'
    r.xadd("agent:{web}:dead", {"entry": json.dumps(letter)})
    private = {k: v for k, v in letter.items() if k != "payload"} | {"private": True}
    kept = r.xadd("agent:{web}:dead", {"entry": json.dumps(private)})
    refused = _main("dlq", "replay", kept, "--redis-url", url)
    assert refused.returncode == 1
    assert "no text of a private payload" in refused.stderr
    assert "purged 2" in _main("dlq", "purge", "--redis-url", url).stdout
    r.close()


@pytest.mark.real_redis
@pytest.mark.slow
def test_demo_runs_end_to_end(redis_server) -> None:  # type: ignore[no-untyped-def]
    res = _run("demo", env={"OPENAI_API_KEY": ""})
    assert res.returncode == 0, res.stderr[-2000:]
    assert "Redis keys holding the secret: 0" in res.stdout
    assert "[session_not_active]" in res.stdout
    assert "(I remember 2 earlier messages)" in res.stdout


@pytest.mark.slow
def test_demo_falls_back_to_an_in_process_server() -> None:
    res = _run("demo", env={"OPENAI_API_KEY": "", "PATH": "/nonexistent"})
    assert res.returncode == 0, res.stderr[-2000:]
    assert "in-process fakeredis" in res.stdout
    assert "Redis keys holding the secret: 0" in res.stdout


def test_the_demo_names_its_own_redis_when_it_goes_away(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The demo's embedded Redis is gone: the line names that server, not the configured
    (default) URL the demo never used."""
    import worker.cli.demo as demo

    gone = f"redis://127.0.0.1:{free_port()}/0"

    @contextlib.contextmanager
    def vanished() -> Iterator[tuple[str, str]]:
        yield gone, "a redis-server that went away"

    monkeypatch.setattr(demo, "embedded_redis", vanished)
    monkeypatch.setenv("OPENAI_API_KEY", "")
    res = _main("demo")
    assert res.returncode == 1
    assert f"lost its Redis at {gone}" in res.stderr, res.stderr
    assert "6379" not in res.stderr


@pytest.mark.real_redis
def test_sessions_and_channels_commands(redis_server) -> None:  # type: ignore[no-untyped-def]
    import asyncio
    import json

    import redis.asyncio as aioredis

    from bus_redis import Keys
    from session_store import RedisSessionStore, Session

    async def seed() -> None:
        r = aioredis.from_url(redis_server.url, decode_responses=True)
        await r.flushall()
        session = Session(key="web:x", scope="web/sender:u")
        session.add_message("user", "hello there")
        await RedisSessionStore(r, Keys()).save(session)
        await r.aclose()

    asyncio.run(seed())
    url = redis_server.url
    listed = _main("sessions", "list", "--redis-url", url)
    assert listed.stdout.startswith("web:x\tweb/sender:u\t1 messages")
    scoped = _main("sessions", "list", "--scope", "web/sender:other", "--redis-url", url)
    assert scoped.stdout == "(no stored sessions in scope web/sender:other)\n"
    shown = json.loads(_main("sessions", "show", "web:x", "--redis-url", url).stdout)
    assert shown["messages"][0]["content"] == "hello there"
    assert _main("sessions", "delete", "web:x", "--redis-url", url).stdout.strip() == "deleted"
    assert _main("sessions", "show", "web:x", "--redis-url", url).returncode == 1

    assert _main("channels", "add", "tele_gram", "--redis-url", url).returncode == 0
    assert "tele_gram" in _main("channels", "list", "--redis-url", url).stdout.split()
    bad = _main("channels", "add", "we:b", "--redis-url", url)
    assert bad.returncode == 2
    assert _main("channels", "remove", "tele_gram", "--redis-url", url).returncode == 0
    assert "tele_gram" not in _main("channels", "list", "--redis-url", url).stdout.split()
