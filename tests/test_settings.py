"""The knobs an operator expects, from the one settings source: system prompt (text or
file), temperature, max tokens, provider timeout and retries, tool allow/deny, history
budget; unknown AGENT_* variables warned about; --version; global options anywhere."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from helpers import ScriptedProvider, run_cli

from bus_redis import FrontendClient, InboundMessage
from worker.agent.providers import LLMResponse, OpenAIProvider
from worker.app import make_provider
from worker.settings import Settings


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, env=env)  # type: ignore[no-any-return]


async def test_prompt_and_tools_reach_the_model(redis_factory, make_loop) -> None:  # type: ignore[no-untyped-def]
    seen: list[dict[str, Any]] = []

    async def answer(**kw: Any) -> LLMResponse:
        seen.append(kw)
        return LLMResponse(content="ok")

    make_loop(
        ScriptedProvider(handler=answer),
        system_prompt="You are Rex, the shop's assistant.",
        tools_deny=["message", "create_goal"],
    )
    client = FrontendClient(redis_factory())
    msg = InboundMessage(channel="web", sender_id="u", chat_id="k", content="hi")
    assert (await client.ask(msg, timeout_s=10)).content == "ok"
    (call,) = seen
    system = call["messages"][0]["content"]
    assert system.startswith("You are Rex, the shop's assistant.")
    assert "helpful assistant running inside" not in system
    offered = {t["function"]["name"] for t in call["tools"]}
    assert offered == {"read_session", "search_sessions", "update_goal", "spawn", "cron"}
    assert "create_goal" not in system  # a denied tool is named nowhere


def test_settings_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("You are Rex.\n")
    for name, value in {
        "AGENT_SYSTEM_PROMPT": "ignored: the file wins",
        "AGENT_SYSTEM_PROMPT_FILE": str(prompt),
        "AGENT_TEMPERATURE": "0.2",
        "AGENT_MAX_TOKENS": "512",
        "AGENT_PROVIDER_TIMEOUT_S": "7.5",
        "AGENT_PROVIDER_DEADLINE_S": "90",
        "AGENT_PROVIDER_RETRIES": "1",
        "AGENT_TOOLS_ALLOW": "read_session, search_sessions",
        "AGENT_HISTORY_TOKENS": "2000",
        "AGENT_PROVIDER": "openai",
    }.items():
        monkeypatch.setenv(name, value)
    settings = Settings()
    config = settings.loop_config()
    assert config.system_prompt == "You are Rex."
    assert config.tools_allow == ["read_session", "search_sessions"]
    assert config.history_tokens == 2000
    provider = make_provider(settings)
    assert isinstance(provider, OpenAIProvider)
    assert (provider.generation.temperature, provider.generation.max_tokens) == (0.2, 512)
    assert provider.max_retries == 1
    assert provider.http.timeout["read"] == 7.5
    assert provider.deadline_s == 90


def test_the_command_line_takes_what_a_user_tries() -> None:
    version = _cli("--version")
    assert version.returncode == 0
    assert version.stdout.startswith("agent-worker ")
    before = _cli("--redis-url", "redis://127.0.0.1:1/0", "status")  # option before the command
    assert before.returncode == 1
    assert before.stdout.startswith("redis: DOWN (redis://127.0.0.1:1/0")
    typo = _cli("status", "--redis-url", "redis://127.0.0.1:1/0", env={"AGENT_TEMPERATUR": "1"})
    assert "agent-worker: warning: AGENT_TEMPERATUR is not a setting (ignored)" in typo.stderr
    bad = _cli("status", env={"AGENT_TOOLS_DENY": "create_gaol"})
    assert bad.returncode == 2
    assert bad.stderr.strip().startswith(
        "agent-worker: bad configuration: unknown tool 'create_gaol'"
    )
    helptext = _cli("run", "--help").stdout
    for name in (
        "AGENT_SYSTEM_PROMPT",
        "AGENT_TEMPERATURE",
        "AGENT_TOOLS_DENY",
        "AGENT_METRICS_PORT",
    ):
        assert name in helptext


@pytest.mark.parametrize("reserved", ["admin", "prune"])
def test_a_worker_may_not_take_the_name_of_a_hold_without_a_turn(
    reserved: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`sessions delete` and the idle prune hold a lease as `<nonce>|admin` / `|prune`,
    entered in the lease registry: a worker of that id found dead (or starting) would
    have its takeover delete a live hold. Such an id is refused where it is set."""
    from pydantic import ValidationError

    from worker.config import LoopConfig

    with pytest.raises(ValidationError, match="is reserved"):
        LoopConfig(worker_id=reserved)
    monkeypatch.setenv("AGENT_WORKER_ID", reserved)
    with pytest.raises(ValidationError, match="is reserved"):
        Settings()
    assert LoopConfig(worker_id=f"{reserved}-1").worker_id == f"{reserved}-1"


def test_an_agent_variable_no_setting_reads_is_named_but_tooling_variables_are_not() -> None:
    from worker.cli.main import unknown_variables

    env = {
        "AGENT_MAX_ITERATION": "3",  # a typo of AGENT_MAX_ITERATIONS
        "AGENT_MAX_ITERATIONS": "3",
        "AGENT_FAULT_POINTS": "after_read",  # the crash tests' fault points
        "AGENT_FAULT_STALL_S": "2",
        "AGENT_GATEWAY_HOST": "127.0.0.1",
        "PATH": "/bin",
    }
    assert unknown_variables(env) == ["AGENT_MAX_ITERATION"]
