"""docker-compose.yml is valid and only runs real commands with real settings."""

from __future__ import annotations

from pathlib import Path

import yaml

from gateway.cli import build_parser as gateway_parser
from gateway.settings import GatewaySettings
from worker.cli.main import build_parser
from worker.settings import Settings

ROOT = Path(__file__).resolve().parents[1]


def test_compose_services_run_real_commands_with_known_settings() -> None:
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = doc["services"]
    assert {"redis", "worker"} <= set(services)
    assert "--appendonly" in services["redis"]["command"]
    known = {f"AGENT_{name.upper()}" for name in Settings.model_fields}
    known_gw = {f"AGENT_GATEWAY_{name.upper()}" for name in GatewaySettings.model_fields}
    known_gw |= {"AGENT_REDIS_URL", "AGENT_KEY_PREFIX"}  # shared with the workers
    ours = [s for s in services.values() if s.get("build")]
    assert ours
    for service in ours:
        command = service["command"]
        assert command[0] in ("agent-worker", "agent-gateway")
        gateway = command[0] == "agent-gateway"
        (gateway_parser() if gateway else build_parser()).parse_args(command[1:])  # exits on junk
        for name in service.get("environment", {}):
            assert not name.startswith("AGENT_") or name in (known_gw if gateway else known), name
    assert services["worker"].get("container_name") is None  # scalable with --scale


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "bash scripts/test.sh" in readme
    assert "exec bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
