"""Redis ACL lines for frontends (one channel each) and for workers (``agent-worker acl``).

A frontend of channel ``C`` may publish into its channel's session streams and ready
queue, publish controls on its channel, and read (and delete) its sessions' events.
It runs no Lua and touches nothing of another channel: no session hash, lease, memory,
dead letter, registry or other channel's key. What it can still do is only to its own
channel, whose messages it is trusted with anyway.
"""

from __future__ import annotations

from bus_redis.keys import Keys, valid_channel

FRONTEND_COMMANDS = (
    "+ping", "+multi", "+exec", "+discard", "+xadd", "+incrby", "+publish",
    "+xread", "+xrevrange", "+xdel",
)  # fmt: skip


def frontend_acl(
    channel: str, password: str, *, prefix: str = "agent", user: str = ""
) -> list[str]:
    """The commands an operator runs for the frontend of ``channel``."""
    if not valid_channel(channel):
        raise ValueError(f"invalid channel name {channel!r}: letters, digits, '_' and '-' only")
    _check_password(password)
    k = Keys(prefix)
    name = user or f"frontend-{channel}"
    tag = f"{prefix}:{{{channel}}}"
    grants = [
        f"%W~{tag}:in:*",  # publish messages and control markers; never read them back
        f"%W~{k.ready(channel)}",
        f"~{tag}:ctl:*",  # INCRBY reads and writes
        f"~{tag}:out:*",  # read its sessions' events; delete a private session's
        f"&{k.control(channel)}",
    ]
    setuser = ["ACL", "SETUSER", name, "reset", "on", f">{password}", "-@all"]
    setuser += [*FRONTEND_COMMANDS, *grants]
    return [" ".join(setuser), f"SADD {k.channels} {channel}"]


def worker_acl(password: str, *, prefix: str = "agent", user: str = "agent-worker") -> list[str]:
    """Workers: every key and pub/sub channel of the prefix (and arq's), no admin commands."""
    _check_password(password)
    parts = ["ACL", "SETUSER", user, "reset", "on", f">{password}", "+@all", "-@dangerous"]
    # PSUBSCRIBE needs its pattern granted literally (Redis matches patterns exactly)
    parts += ["+info", f"~{prefix}:*", "~arq:*", f"&{prefix}:*", f"&{Keys(prefix).control_pattern}"]
    return [" ".join(parts)]


def _check_password(password: str) -> None:
    if len(password) < 8 or any(ch.isspace() for ch in password):
        raise ValueError("the password needs 8 or more characters and no whitespace")
