"""A careless operator (a helper's attack, stop 51): settings at their edges must be
refused as bad configuration (one line, exit 2, the variable named), never accepted and
then refused by Redis mid-commit or crash a process at start. Both failed before stop 51."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _gateway(env: dict[str, str], timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    """``agent-gateway`` as a process, on a Redis nobody listens on (a bad configuration
    must be refused before any connection is tried)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_")}
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={
            **base,
            "AGENT_REDIS_URL": "redis://127.0.0.1:1/0",
            "AGENT_GATEWAY_TOKENS": "a-long-enough-token=me",
            **env,
        },
    )


# --- (a) settings at their edges ---------------------------------------------------------
@pytest.mark.frontend
def test_a_gateway_session_ttl_of_inf_is_one_line_not_a_traceback() -> None:
    """README: "Bad configuration ends with one line on stderr and a non-zero exit".
    ``AGENT_GATEWAY_SESSION_TTL_S`` is a float with ``ge=0`` and no upper bound, so
    ``inf`` (an operator's "keep them for ever", where the docs say 0) passes validation;
    the gateway then dies in its ASGI lifespan, ``int(inf * 1000)``: an OverflowError
    traceback and uvicorn's "Application startup failed" (exit 3), not the exit-2
    "bad configuration" line every other bad value gets."""
    res = _gateway({"AGENT_GATEWAY_SESSION_TTL_S": "inf"})
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert (
        "AGENT_GATEWAY_SESSION_TTL_S".lower() in res.stderr.lower() or "session_ttl_s" in res.stderr
    )


@pytest.mark.parametrize(
    "name",
    [
        "AGENT_REPLY_MAXLEN",
        "AGENT_REPLY_TTL_MS",
        "AGENT_TRANSIENT_REPLY_TTL_MS",
        "AGENT_LOCK_TTL_MS",
    ],
)
def test_a_number_no_redis_command_can_take_is_bad_configuration(name: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """README: "Bad configuration ends with one line on stderr and a non-zero exit".
    These settings are ints with a floor and no ceiling, and each goes into a Redis
    command as it is (``MAXLEN ~``, ``PEXPIRE``, ``SET PX``). An operator's "for ever"
    (twenty nines) passes validation, and then, on a real server:

    - ``AGENT_REPLY_MAXLEN``: every commit fails ("value is not an integer or out of
      range", commit.lua); the worker runs, logs a traceback per turn, and no message is
      ever answered;
    - ``AGENT_REPLY_TTL_MS``: commit.lua fails at its ``PEXPIRE`` *after* it wrote the
      rows, the answer and the acknowledgement (a Lua script is not undone on an error):
      no pulse entry (the gateway never sees the answer), the event stream without a TTL,
      the lease not released (each later message of the session waits for it to run out);
    - ``AGENT_LOCK_TTL_MS``: ``run`` exits with "Redis error: value is not an integer or
      out of range script: <sha>, on @user_script:14", which names no setting.

    Expected: refused as bad configuration (exit 2, the variable named), before Redis
    is reached."""
    from worker.cli.main import main

    monkeypatch.setenv(name, "9" * 20)
    code = main(["status", "--redis-url", "redis://127.0.0.1:1/0"])
    assert code == 2, f"{name}=99999999999999999999 was accepted (exit {code})"
