"""A redis-server process started by the tests themselves, on a free port."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def redis_server_binary() -> str | None:
    """``redis-server`` on the PATH, or the server named by ``REDIS_SERVER`` (e.g. a
    ``valkey-server``: the tests and benchmarks then run against it)."""
    return shutil.which(os.environ.get("REDIS_SERVER") or "redis-server")


class RedisServer:
    def __init__(
        self, *, aof: bool = False, port: int | None = None, extra: list[str] | None = None
    ) -> None:
        binary = redis_server_binary()
        if binary is None:
            raise RuntimeError("redis-server is not installed")
        self.binary = binary
        self.fixed_port = port is not None
        self.port = port or free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="raw-redis-"))
        self.aof = aof
        self.extra = extra or []
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.dir),
            "--save",
            "",
            "--appendonly",
            "yes" if self.aof else "no",
            "--appendfsync",
            "always",
            "--logfile",
            str(self.dir / "redis.log"),
            *self.extra,
        ]
        for _ in range(5):
            log = self.dir / "redis.log"
            since = log.stat().st_size if log.exists() else 0
            args[2] = str(self.port)
            self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                self._wait_ready(since)
                return self
            except _PortTakenError:  # another test process's server took it (pytest-xdist)
                if self.fixed_port:
                    raise
                self.port = free_port()
        raise RuntimeError("redis-server found no free port in 5 tries")

    def _wait_ready(self, since: int = 0, timeout_s: float = 10.0) -> None:
        """Up once its own log (from ``since``) says it accepts connections and it answers:
        a PING alone may reach another process's server that holds the port."""
        deadline = time.monotonic() + timeout_s
        log = self.dir / "redis.log"
        while time.monotonic() < deadline:
            assert self.proc is not None
            text = log.read_bytes()[since:].decode(errors="replace") if log.exists() else ""
            if self.proc.poll() is not None:
                if "already in use" in text:
                    raise _PortTakenError(text[-300:])
                raise RuntimeError(f"redis-server exited: {text[-500:]}")
            if "Ready to accept connections" not in text:
                time.sleep(0.02)
                continue
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith((b"+PONG", b"-NOAUTH")):  # up (with a password)
                        return
            except OSError:
                pass
            time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def stop(self, *, kill: bool = False) -> None:
        if self.proc is None:
            return
        if kill:
            self.proc.kill()
        else:
            self.proc.terminate()
        self.proc.wait(timeout=10)
        self.proc = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class _PortTakenError(RuntimeError):
    """The server could not bind its port."""


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_redis_server() -> None:
    """Skip without redis-server, except in CI (``CI=true``), where it fails the test."""
    import pytest

    if redis_server_binary() is None:
        if in_ci():
            pytest.fail("redis-server is missing in CI: scripts/test.sh installs it")
        pytest.skip("redis-server not installed (run scripts/test.sh to install it)")
