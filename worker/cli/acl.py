"""``agent-worker acl frontend|worker``: print the Redis ACL commands to run."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from worker.acl import frontend_acl, worker_acl
from worker.settings import Settings


def register(sub: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser(
        "acl",
        help="print the ACL SETUSER lines for a frontend (one channel) or for workers",
        description="Print Redis commands (run them with redis-cli as an admin). A frontend "
        "user may publish, stop/discard and read events in its own channel only; the "
        "channel is also registered so that workers serve it.",
    )
    common(p)
    p.add_argument("role", choices=["frontend", "worker"])
    p.add_argument("--channel", help="frontend: the channel it serves")
    p.add_argument("--password", required=True, help="the user's password (8+ characters)")
    p.add_argument("--user", help="user name (default frontend-CHANNEL / agent-worker)")
    p.set_defaults(handler=acl)


async def acl(args: argparse.Namespace, settings: Settings) -> int:
    try:
        if args.role == "frontend":
            if not args.channel:
                print("agent-worker: acl frontend needs --channel", file=sys.stderr)
                return 2
            lines = frontend_acl(
                args.channel, args.password, prefix=settings.key_prefix, user=args.user or ""
            )
        else:
            lines = worker_acl(
                args.password, prefix=settings.key_prefix, user=args.user or "agent-worker"
            )
    except ValueError as exc:
        print(f"agent-worker: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0
