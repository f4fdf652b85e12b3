"""Checks shared by every process's settings (workers, gateways): the Redis URL and the
log level. Messages never echo the URL (it may hold a password)."""

from __future__ import annotations

import logging
from urllib.parse import urlsplit


def check_redis_url(value: str) -> str:
    if not value.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError("must start with redis://, rediss:// or unix://")
    try:
        urlsplit(value).port  # noqa: B018 - parses host and port
    except ValueError:
        # the message must not echo the URL: a stray '#' or '/' cuts the password
        raise ValueError("is not a valid URL (URL-encode the password)") from None
    return value


def check_log_level(value: str) -> str:
    level = value.upper()
    if level not in logging.getLevelNamesMapping():
        raise ValueError("must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL")
    return level


def package_version() -> str:
    """The installed version of redis-agent-worker (``--version`` of both commands)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("redis-agent-worker")
    except PackageNotFoundError:
        return "unknown"
