"""Real ``agent-worker run`` processes for multi-process tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
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


def crash_env(
    tmp_path: Path, target: str, when: str = "after", match: str = "", *, how: str = "exit"
) -> dict[str, str]:
    """Worker environment whose ``sitecustomize`` wraps ``target``
    (``module:Class.method``, a coroutine function) so that the process exits 137 (as
    under kill -9) just before or just after the first call whose arguments' repr
    contains ``match``; ``how="stop"``: it stops itself instead (SIGSTOP, every thread:
    the liveness beat too), once, and SIGCONT wakes it (a kill -STOP mid call)."""
    site = tmp_path / "crashsite"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(
        textwrap.dedent(
            """
            import functools, importlib, os, signal
            _spec = os.environ.get("CRASH_AT", "")
            if _spec:
                _mod, _attr = _spec.split(":")
                _when = os.environ.get("CRASH_WHEN", "after")
                _match = os.environ.get("CRASH_MATCH", "")
                _obj = importlib.import_module(_mod)
                _parts = _attr.split(".")
                for _p in _parts[:-1]:
                    _obj = getattr(_obj, _p)
                _orig = getattr(_obj, _parts[-1])

                _how = os.environ.get("CRASH_HOW", "exit")
                _done = []

                def _act():
                    if _how == "stop":
                        os.kill(os.getpid(), signal.SIGSTOP)
                    else:
                        os._exit(137)

                @functools.wraps(_orig)
                async def _crashing(*args, **kwargs):
                    hit = not _done and _match in repr((args, kwargs))
                    if hit:
                        _done.append(1)
                    if hit and _when == "before":
                        _act()
                    result = await _orig(*args, **kwargs)
                    if hit and _when == "after":
                        _act()
                    return result

                setattr(_obj, _parts[-1], _crashing)
            """
        )
    )
    return {
        "PYTHONPATH": f"{site}:{Path(__file__).resolve().parents[1]}",
        "CRASH_AT": target,
        "CRASH_WHEN": when,
        "CRASH_MATCH": match,
        "CRASH_HOW": how,
    }
