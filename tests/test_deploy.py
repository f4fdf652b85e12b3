"""docker-compose.yml deploys what it says, checked without Docker (images cannot be
pulled in CI): every AGENT_* it sets is a real setting, every command of ours parses, the
services wait for what they need, and the start-up step and the healthchecks run against a
live stack started from the very same commands and environment (a redis-server with the
compose's arguments, a worker and a gateway process)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from gateways import GatewayProcess
from servers import RedisServer, free_port, require_redis_server
from workers import WorkerProcess

from gateway.cli import build_parser as gateway_parser
from gateway.settings import GatewaySettings
from worker.cli.main import build_parser
from worker.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
ENV = {  # what an operator puts in .env
    "REDIS_ADMIN_PASSWORD": "admin-pw-123456",
    "WORKER_PASSWORD": "worker-pw-123456",
    "GATEWAY_PASSWORD": "gateway-pw-123456",
    "AGENT_GATEWAY_TOKENS": "tok-0123456789=me",
}
_VAR = re.compile(r"\$\{(\w+)(?::([-?])([^}]*))?\}")


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's ``${NAME}``, ``${NAME:-default}``, ``${NAME:?error}`` and ``$$``."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match[str]) -> str:
        name, kind, rest = m.group(1), m.group(2), m.group(3)
        if env.get(name):
            return env[name]
        if kind == "?":
            raise KeyError(f"{name}: {rest}")
        return rest or ""

    return _VAR.sub(one, value.replace("$$", "\0")).replace("\0", "$")


def compose(env: dict[str, str] | None = None) -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return dict(interpolate(doc, env if env is not None else ENV))


def _redis_args(command: list[str], env: dict[str, str], data_dir: str) -> list[str]:
    """The redis-server arguments of the compose's ``sh -c "... && exec redis-server ..."``,
    with the shell's variables filled in and /data as ``data_dir``."""
    assert command[:2] == ["sh", "-c"]
    line = command[2].split("exec ", 1)[1]
    for name, value in env.items():
        line = line.replace(f"${name}", value)
    args = shlex.split(line.replace("/data/", f"{data_dir}/"))
    assert args[0] == "redis-server"
    return args[1:]


def _agent_commands(command: list[str]) -> list[list[str]]:
    """Our commands in a service: ``[prog, args...]``, or each of ``sh -c "a && b"``."""
    if command[:2] == ["sh", "-c"]:
        return [shlex.split(part) for part in command[2].split("&&")]
    return [command]


def test_compose_services_run_real_commands_with_known_settings() -> None:
    services = compose()["services"]
    known = {f"AGENT_{name.upper()}" for name in Settings.model_fields}
    known_gw = {f"AGENT_GATEWAY_{name.upper()}" for name in GatewaySettings.model_fields}
    known_gw |= {"AGENT_REDIS_URL", "AGENT_KEY_PREFIX"}  # shared with the workers
    ours = {name: s for name, s in services.items() if s.get("build")}
    assert {"redis-acl", "worker", "gateway"} <= set(ours)
    for service in ours.values():
        for command in _agent_commands(service["command"]):
            gateway = command[0] == "agent-gateway"
            assert command[0] in ("agent-worker", "agent-gateway")
            (gateway_parser() if gateway else build_parser()).parse_args(command[1:])
            for name in service.get("environment", {}):
                assert not name.startswith("AGENT_") or name in (known_gw if gateway else known)
        check = service.get("healthcheck", {}).get("test")
        if check and check[1] == "agent-worker":
            build_parser().parse_args(check[2:])
    with pytest.raises(KeyError, match="REDIS_ADMIN_PASSWORD"):
        compose({})  # no password: compose refuses to start


def test_compose_waits_for_health_restarts_and_publishes_nothing_open() -> None:
    services = compose()["services"]
    redis, worker, gateway = services["redis"], services["worker"], services["gateway"]
    args = _redis_args(redis["command"], {"REDIS_ADMIN_PASSWORD": "x"}, "/data")
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    assert "--aclfile" in args  # the ACL users survive a restart
    assert "ports" not in redis  # deploy/redis-port.yml adds 127.0.0.1 only
    for service in (worker, gateway):
        assert service["restart"] == "unless-stopped"
        assert service["depends_on"]["redis"]["condition"] == "service_healthy"
        assert service["depends_on"]["redis-acl"]["condition"] == "service_completed_successfully"
        assert "healthcheck" in service
    assert worker.get("container_name") is None  # scalable with --scale
    grace = float(worker["environment"]["AGENT_SHUTDOWN_GRACE_S"])
    assert float(worker["stop_grace_period"].removesuffix("s")) > grace
    assert all(p.startswith("127.0.0.1:") for s in services.values() for p in s.get("ports", []))
    extra = yaml.safe_load((ROOT / "deploy" / "redis-port.yml").read_text())
    assert extra["services"]["redis"]["ports"][0].startswith("127.0.0.1:")
    llm_env = (ROOT / "deploy" / "local-llm.env").read_text()
    assert "OPENAI_BASE_URL=http://llm:11434/v1" in llm_env
    assert services["llm-pull"]["environment"]["OLLAMA_HOST"] == "http://llm:11434"
    assert "ollama-data:/root/.ollama" in services["llm"]["volumes"]
    prometheus = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    ports = {c["job_name"]: c["dns_sd_configs"][0]["port"] for c in prometheus["scrape_configs"]}
    assert ports == {"workers": int(worker["environment"]["AGENT_METRICS_PORT"]), "gateway": 8080}
    assert ".venv" in (ROOT / ".dockerignore").read_text().split()


def test_start_up_and_healthchecks_run_against_a_live_stack() -> None:
    require_redis_server()
    services = compose()["services"]
    server = RedisServer()
    (server.dir / "users.acl").touch()  # what the compose's sh -c does first
    server.extra = _redis_args(services["redis"]["command"], ENV, str(server.dir))
    server.start()
    here = f"127.0.0.1:{server.port}"
    metrics_port = free_port()

    def env_of(name: str) -> dict[str, str]:
        env = {k: str(v) for k, v in services[name].get("environment", {}).items()}
        return {k: v.replace("@redis:6379", f"@{here}") for k, v in env.items()}

    def run(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        if command[0] in ("agent-worker", "agent-gateway"):
            module = "worker.cli.main" if command[0] == "agent-worker" else "gateway.cli"
            command = [sys.executable, "-m", module, *command[1:]]
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        return subprocess.run(  # the image's PATH has agent-worker; so has this venv's bin
            command, env={**os.environ, **env, "PATH": path}, capture_output=True, text=True,
            timeout=60,
        )  # fmt: skip

    worker = gateway = None
    try:
        check = services["redis"]["healthcheck"]["test"]
        assert check[0] == "CMD-SHELL"
        shell = check[1].replace("redis-cli", f"redis-cli -p {server.port}")
        assert run(["sh", "-c", shell], env_of("redis")).returncode == 0
        acl = run(services["redis-acl"]["command"], env_of("redis-acl"))
        assert acl.returncode == 0, acl.stderr
        assert "worker-pw" not in acl.stdout + acl.stderr
        server.stop()  # a Redis restart keeps the users (and the admin's password)
        server.start()
        anonymous = run(["redis-cli", "-p", str(server.port), "ping"], {})
        assert "NOAUTH" in anonymous.stdout + anonymous.stderr
        unhealthy = run(services["worker"]["healthcheck"]["test"][1:], env_of("worker"))
        assert unhealthy.returncode == 1  # no worker yet
        wenv = {**env_of("worker"), "AGENT_METRICS_PORT": str(metrics_port)}
        worker = WorkerProcess(wenv.pop("AGENT_REDIS_URL"), worker_id="composed", env=wenv)
        genv = env_of("gateway")
        gateway = GatewayProcess(genv.pop("AGENT_REDIS_URL"), name="composed-gw", env=genv)

        def healthy() -> bool:
            res = run(services["worker"]["healthcheck"]["test"][1:], env_of("worker"))
            return res.returncode == 0

        assert _until(healthy, timeout_s=30), worker.log()[-2000:]
        probe = services["gateway"]["healthcheck"]["test"][1:]
        probe = [p.replace("127.0.0.1:8080", f"127.0.0.1:{gateway.port}") for p in probe]
        assert run(probe, {}).returncode == 0
        metrics = run(
            ["python", "-c", "import urllib.request as u; print(u.urlopen("
             f"'http://127.0.0.1:{metrics_port}/metrics', timeout=3).read().decode())"], {},
        )  # fmt: skip
        assert "agent_turns_in_flight" in metrics.stdout
    finally:
        for proc in (worker, gateway):
            if proc is not None:
                print(proc.log()[-2000:])
                proc.close()
        server.cleanup()


def _until(predicate: Callable[[], bool], *, timeout_s: float) -> bool:
    """Poll ``predicate`` (a subprocess each time) until true or ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "bash scripts/test.sh" in readme
    assert "exec bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
