"""Redis ACL lines for frontends (one channel each) and for workers (``agent-worker acl``).

A frontend of channel ``C`` may publish into its channel's session streams and ready
queue, publish controls on its channel, and read (and delete) its sessions' events.
It runs no Lua and touches nothing of another channel: no session hash, lease, memory,
dead letter, registry or other channel's key. What it can still do is only to its own
channel, whose messages it is trusted with anyway.
"""

from __future__ import annotations

from bus_redis.keys import Keys, valid_channel


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
    # Redis 7 selectors: each command only on the keys it is for, so a frontend cannot
    # even give its own keys a type the workers do not expect.
    setuser = ["ACL", "SETUSER", name, "reset", "on", f">{password}", "-@all"]
    setuser += ["+ping", "+multi", "+exec", "+discard", "+unwatch"]
    # what client libraries send on connect: a name, the protocol, the default database
    setuser += ["+hello", "+client|setname", "+select|0"]
    setuser += ["+xadd", f"%W~{tag}:in:*", f"%W~{k.ready(channel)}"]  # publish; never read back
    setuser += [f"(+incrby ~{tag}:ctl:*)"]  # the marker hint
    setuser += [f"(+watch +xlen ~{tag}:in:*)"]  # followup=reject: is the session busy?
    setuser += [f"(+zadd ~{k.queued(channel)})"]  # the sweep's index of sessions with work
    setuser += [f"(+xread +xrevrange +xdel +type ~{tag}:out:*)"]  # events; delete a private one's
    setuser += [f"(+xread +xrevrange +xrange ~{k.pulse(channel)})"]  # which streams got events
    setuser += [f"(+publish &{k.control(channel)})"]
    return [" ".join(setuser), f"SADD {k.channels} {channel}"]


def gateway_acl(channel: str, password: str, *, prefix: str = "agent", user: str = "") -> list[str]:
    """A gateway (``agent-gateway``) of ``channel``: everything a frontend may do, plus
    read-only looks at its channel's sessions (queued count, whether a turn runs, stored
    rows) and its own keys ``P:{C}:gw:*`` (users' chat lists, the key tickets are signed with, a wake stream)."""
    lines = frontend_acl(channel, password, prefix=prefix, user=user or f"gateway-{channel}")
    tag = f"{prefix}:{{{channel}}}"
    extra = [
        f"(+xlen ~{tag}:in:*)",  # messages queued
        f"(+exists ~{tag}:lease:*)",  # a turn is running
        f"(+hget +hmget ~{tag}:session:*)",  # stored history, read only
        # one selector for the shared blocking read: the pulse and the replica's wake stream
        f"(+xread +xrevrange +xrange +type ~{tag}:out:* ~{tag}:gw:wake:* ~{tag}:pulse)",
        f"(+xadd +pexpire ~{tag}:gw:wake:*)",
        f"(+zadd +zrem +zremrangebyrank +zscore +zcard +zrevrange +zrangebyscore +zpopmin +hset +hsetnx +hget +hmget +hdel ~{tag}:gw:user:*)",
        f"(+set ~{tag}:gw:ticket:secret)",
        # a write's check (gateway.backlog): the chat's stream and the user's lists at once
        f"(+watch ~{tag}:in:* ~{tag}:gw:user:*)",
    ]
    return [f"{lines[0]} {' '.join(extra)}", *lines[1:]]


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
