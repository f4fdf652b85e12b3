"""The command line fails with one clear line, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest
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


def test_bad_configuration_is_one_line() -> None:
    res = _run("status", env={"AGENT_CONCURRENCY": "many"})
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0
    assert "AGENT_CONCURRENCY" in res.stderr
    assert "Traceback" not in res.stderr


def test_unreachable_redis_is_one_line() -> None:
    res = _run("send", "hi", "--redis-url", f"redis://127.0.0.1:{free_port()}/0", "--timeout", "1")
    assert res.returncode == 1
    assert "cannot reach Redis" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.real_redis
def test_status_and_sessions_against_a_real_server(redis_server) -> None:  # type: ignore[no-untyped-def]
    res = _run("status", "--redis-url", redis_server.url)
    assert res.returncode == 0, res.stderr
    assert "redis: up" in res.stdout
    res = _run("memory", "set", "remember the milk", "--redis-url", redis_server.url)
    assert res.returncode == 0
    assert (
        _run("memory", "show", "--redis-url", redis_server.url).stdout.strip()
        == "remember the milk"
    )
