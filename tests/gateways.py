"""Real ``agent-gateway`` processes and a small TCP load balancer in front of them."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from servers import free_port


class GatewayProcess:
    def __init__(self, redis_url: str, *, name: str, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.port = free_port()
        self.log_path = Path(tempfile.mkstemp(prefix=f"{name}-", suffix=".log")[1])
        self._log = self.log_path.open("wb")
        full_env = {**os.environ, "AGENT_REDIS_URL": redis_url, **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "--port", str(self.port)],
            env=full_env,
            stdout=self._log,
            stderr=self._log,
        )
        self._wait_ready()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _wait_ready(self, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway {self.name} exited: {self.log()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200:
                    return
            time.sleep(0.05)
        raise RuntimeError(f"gateway {self.name} did not start: {self.log()[-2000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def close(self) -> None:
        self.kill()
        self._log.close()
        self.log_path.unlink(missing_ok=True)


class LoadBalancer:
    """TCP proxy: each new connection goes to the next backend that accepts it (round
    robin), or to the first one that does (``failover``: one replica serves everything
    until it dies), so a killed replica's clients reconnect to the others."""

    def __init__(self, backends: list[int], *, failover: bool = False) -> None:
        self.backends = backends
        self.failover = failover
        self._next = itertools.cycle(range(len(backends)))
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        order = (
            range(len(self.backends))
            if self.failover
            else (next(self._next) for _ in self.backends)
        )
        for i in order:
            port = self.backends[i]
            try:
                upstream = socket.create_connection(("127.0.0.1", port), timeout=2)
            except OSError:
                continue
            upstream.settimeout(None)
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=_pipe, args=(upstream, client), daemon=True).start()
            _pipe(client, upstream)
            return
        client.close()

    def close(self) -> None:
        self._closed = True
        self.sock.close()


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
