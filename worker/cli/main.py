"""``agent-worker``: run workers, talk to them, inspect and administer the bus."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import sys
from collections.abc import Callable, Coroutine
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from pydantic import ValidationError
from redis.exceptions import AuthenticationError, RedisError
from redis.exceptions import ConnectionError as RedisConnectionError

from bus_redis.config import package_version
from session_store import SessionBusyError
from worker.runtime.eventloop import loop_factory
from worker.runtime.registration import WorkerConflictError
from worker.settings import Settings

Command = Callable[[argparse.Namespace, Settings], Coroutine[Any, Any, int]]


def _common(p: argparse.ArgumentParser) -> None:
    """Options every command takes, before or after its name (``SUPPRESS``: an option
    given in one place is not reset by the other's default)."""
    p.add_argument(
        "--redis-url",
        default=argparse.SUPPRESS,
        help="Redis URL (env AGENT_REDIS_URL; default redis://localhost:6379/0)",
    )
    p.add_argument(
        "--prefix",
        dest="key_prefix",
        default=argparse.SUPPRESS,
        help="key prefix (env AGENT_KEY_PREFIX; default agent)",
    )


def build_parser() -> argparse.ArgumentParser:
    from worker.cli import acl, admin, demo, frontend, runner, schedules, status

    parser = argparse.ArgumentParser(
        prog="agent-worker",
        description="Redis-backed, horizontally scalable worker for chat-agent turns.",
        epilog="Configuration comes from AGENT_* environment variables; options override them.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    _common(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (runner, frontend, status, admin, schedules, acl, demo):
        module.register(sub, _common)
    return parser


def load_settings(args: argparse.Namespace) -> Settings:
    overrides = {
        name: getattr(args, name)
        for name in Settings.model_fields
        if getattr(args, name, None) is not None
    }
    return Settings(**overrides)


# AGENT_* names read by other parts (the gateway, the test and bench tooling, the fault
# points the crash tests set: worker/runtime/faults.py)
OTHER_AGENT_VARIABLES = ("AGENT_GATEWAY_", "AGENT_WORKER_PYTHON", "AGENT_TEST_", "AGENT_FAULT_")


def unknown_variables(environ: dict[str, str]) -> list[str]:
    """``AGENT_*`` variables no setting reads (a typo silently changes nothing). Settings
    are read whatever the case of their names, so these are compared so too."""
    known = {f"AGENT_{name.upper()}" for name in Settings.model_fields}
    return sorted(
        name
        for name in environ
        if name.upper().startswith("AGENT_")
        and name.upper() not in known
        and not name.upper().startswith(OTHER_AGENT_VARIABLES)
    )


def redact_url(url: str) -> str:
    """The Redis URL without its password, in the user part or the query (never printed
    or logged); a URL that does not parse is shown without anything before its '@'."""
    try:
        parts = urlsplit(url)
        if parts.password is None and "password=" not in parts.query.lower() and "@" not in url:
            return url
        if parts.fragment or (parts.port is None and ":" in parts.netloc.rpartition("@")[2]):
            raise ValueError("a stray '#' or ':' in the password")
        query = re.sub(r"(?i)(password=)[^&]*", r"\1***", parts.query)
        netloc = parts.netloc
        if "@" in netloc and parts.password is None:  # a bare userinfo may be a token
            netloc = "***@" + netloc.rpartition("@")[2]
        if parts.password is not None:
            host = parts.hostname or ""
            netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
        return urlunsplit(parts._replace(netloc=netloc, query=query))
    except ValueError:
        scheme, _, rest = url.partition("://")
        return f"{scheme}://***@{rest.rpartition('@')[2]}" if "@" in rest else f"{scheme}://***"


def _config_error(exc: ValidationError) -> str:
    first = exc.errors()[0]
    if not first["loc"]:  # a rule across settings: its message names them
        return f"agent-worker: bad configuration: {first['msg'].removeprefix('Value error, ')}"
    name = "AGENT_" + "_".join(str(p) for p in first["loc"]).upper()
    return f"agent-worker: bad configuration: {name}: {first['msg']}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = load_settings(args)
    except ValidationError as exc:
        print(_config_error(exc), file=sys.stderr)
        return 2
    command: Command = args.handler
    for name in unknown_variables(dict(os.environ)):
        print(f"agent-worker: warning: {name} is not a setting (ignored)", file=sys.stderr)
    try:
        # a worker coalesces its wake-ups (worker/runtime/eventloop.py); other commands don't
        linger = settings.loop_linger_us if getattr(args, "linger", False) else 0
        with asyncio.Runner(loop_factory=loop_factory(linger)) as runner:
            code = runner.run(command(args, settings))
        sys.stdout.flush()  # here, so that a reader gone away is handled below
        return code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (| head): not a Redis problem
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except WorkerConflictError as exc:
        print(f"agent-worker: {exc}", file=sys.stderr)
        return 2
    except SessionBusyError as exc:  # (a TimeoutError, so an OSError: not "unreachable")
        print(f"agent-worker: {exc}; try again once its turn is done", file=sys.stderr)
        return 1
    except AuthenticationError as exc:
        print(
            f"agent-worker: Redis refused the credentials at {redact_url(settings.redis_url)}: {exc}",
            file=sys.stderr,
        )
        return 1
    except (RedisConnectionError, ConnectionRefusedError, OSError) as exc:
        where = redact_url(settings.redis_url)
        print(f"agent-worker: cannot reach Redis at {where}: {exc}", file=sys.stderr)
        return 1
    except RedisError as exc:
        print(f"agent-worker: Redis error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
