"""``agent-worker acl frontend|gateway|worker``: print the Redis ACL commands to run."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from redis.exceptions import ResponseError

from bus_redis.acl import frontend_acl, gateway_acl, worker_acl
from worker.app import make_redis
from worker.settings import Settings


def register(sub: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser(
        "acl",
        help="print the ACL SETUSER lines for a frontend or gateway (one channel), workers, "
        "or the admin (Redis's default user)",
        description="Print Redis commands (run them with redis-cli as an admin). A frontend "
        "user may publish, stop/discard and read events in its own channel only; the "
        "channel is also registered so that workers serve it. A gateway (agent-gateway) "
        "gets a frontend's grants plus read-only looks at its channel's sessions and its "
        "own P:{C}:gw:* keys (docs/ACL.md). 'default' sets a password on Redis's default "
        "user, the admin that runs these lines.",
    )
    common(p)
    p.add_argument("role", choices=["frontend", "gateway", "worker", "default"])
    p.add_argument("--channel", help="frontend / gateway: the channel it serves")
    p.add_argument("--password", required=True, help="the user's password (8+ characters)")
    p.add_argument(
        "--user", help="user name (default frontend-CHANNEL / gateway-CHANNEL / agent-worker)"
    )
    # role default: the admin's password (Redis's default user), for a deployment's start-up
    p.add_argument(
        "--apply",
        action="store_true",
        help="run the commands on --redis-url / AGENT_REDIS_URL (as an admin) instead of "
        "printing them (a deployment's start-up step)",
    )
    p.set_defaults(handler=acl)


def _other_role(role: str, user: str) -> str | None:
    """Why ``user`` must not be reset to ``role``'s grants, if it must not: it is the
    admin (Redis's default user: it would lose ACL and CONFIG, and nobody could repair
    it), or another role's own user (every worker reduced to a frontend's grants)."""
    if user == "default":
        return "'default' is Redis's admin user: acl default sets its password"
    if role != "worker" and user == "agent-worker":
        return "'agent-worker' is the workers' user"
    if role == "worker" and user.startswith(("frontend-", "gateway-")):
        return f"{user!r} is a frontend's or gateway's user"
    return None


async def acl(args: argparse.Namespace, settings: Settings) -> int:
    if args.role != "default" and args.user and (why := _other_role(args.role, args.user)):
        print(f"agent-worker: refused --user {args.user}: {why}", file=sys.stderr)
        return 2
    try:
        if args.role in ("frontend", "gateway"):
            if not args.channel:
                print(f"agent-worker: acl {args.role} needs --channel", file=sys.stderr)
                return 2
            make = frontend_acl if args.role == "frontend" else gateway_acl
            lines = make(
                args.channel, args.password, prefix=settings.key_prefix, user=args.user or ""
            )
        elif args.role == "default":  # the admin: Redis's default user, with a password
            if len(args.password) < 8 or any(ch.isspace() for ch in args.password):
                raise ValueError("the password needs 8 or more characters and no whitespace")
            # resetpass first: a new password replaces the old ones (a leaked one stops
            # working), where '>' alone would add one
            lines = [f"ACL SETUSER default on resetpass >{args.password}"]
        else:
            lines = worker_acl(
                args.password, prefix=settings.key_prefix, user=args.user or "agent-worker"
            )
    except ValueError as exc:
        print(f"agent-worker: {exc}", file=sys.stderr)
        return 2
    if not args.apply:
        print("\n".join(lines))
        return 0
    redis = make_redis(settings.redis_url)
    try:
        for line in lines:
            await redis.execute_command(*line.split())
        try:  # kept across restarts when the server has an ACL file (the compose's has)
            await redis.execute_command("ACL", "SAVE")
        except ResponseError as exc:
            if "ACL file" not in str(exc):
                raise
    finally:
        await redis.aclose()
    print(f"applied: {lines[0].split()[2]} ({args.role})")  # the user name, never the password
    return 0
