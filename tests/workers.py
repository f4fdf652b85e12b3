"""Real ``agent-worker run`` processes for multi-process tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path


class WorkerProcess:
    def __init__(
        self, redis_url: str, *, worker_id: str, env: dict[str, str] | None = None
    ) -> None:
        self.worker_id = worker_id
        self.log_path = Path(tempfile.mkstemp(prefix=f"{worker_id}-", suffix=".log")[1])
        full_env = {
            **os.environ,
            "AGENT_REDIS_URL": redis_url,
            "AGENT_WORKER_ID": worker_id,
            "AGENT_LOG_LEVEL": "INFO",
            **(env or {}),
        }
        self._log = self.log_path.open("wb")
        # the frontend suite runs in a venv without the worker's dependencies (newest
        # redis-py): workers then come from the worker's own venv (scripts/test.sh)
        python = os.environ.get("AGENT_WORKER_PYTHON") or sys.executable
        self.proc = subprocess.Popen(
            [python, "-m", "worker.cli.main", "run"],
            env=full_env,
            stdout=self._log,
            stderr=self._log,
        )

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def terminate(self, timeout_s: float = 20) -> int:
        self.signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
        self.log_path.unlink(missing_ok=True)
