"""``agent-worker run``: one worker process."""

from __future__ import annotations

import argparse
import logging
import signal
from collections.abc import Callable
from typing import Any

from worker.app import make_loop, make_redis
from worker.ops.logs import setup_logging
from worker.runtime import collector
from worker.runtime.backoff import Backoff
from worker.settings import Settings

log = logging.getLogger("worker")


def register(sub: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser(
        "run",
        help="run a worker (SIGTERM drains and exits 0)",
        description="Run one worker: consume the shared ready queue until SIGTERM/SIGINT, "
        "then finish running turns within AGENT_SHUTDOWN_GRACE_S and release every lease. "
        "Exits 2 when its AGENT_WORKER_ID is in use by a live worker at start, or was "
        "claimed by another process while this one was stopped (SIGSTOP).",
        epilog=_settings_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common(p)
    p.add_argument(
        "--provider", choices=["openai", "echo"], help="env AGENT_PROVIDER (default echo)"
    )
    p.add_argument("--model", help="env AGENT_MODEL")
    p.add_argument("--worker-id", help="env AGENT_WORKER_ID (default host-pid-random)")
    p.add_argument("--concurrency", type=int, help="max concurrent turns (env AGENT_CONCURRENCY)")
    p.add_argument(
        "--unified-session", action="store_true", default=None, help="env AGENT_UNIFIED_SESSION"
    )
    p.set_defaults(handler=run, linger=True)


async def _connect(redis: Any, where: str, stopped: Any) -> bool:
    """Wait for Redis with backoff (it may be starting, restarting or out of connections:
    ``maxclients``); wrong credentials and missing permissions end the worker at once.
    False when a signal asked to stop meanwhile."""
    import asyncio

    from redis.exceptions import AuthenticationError, NoPermissionError, RedisError

    backoff = Backoff(f"connecting to Redis at {where}", log, first_s=0.2, cap_s=5.0)
    while not stopped.is_set():
        try:
            await redis.ping()
            return True
        except (AuthenticationError, NoPermissionError):
            raise
        except (RedisError, OSError) as exc:
            log.warning("cannot reach Redis at %s: %s", where, str(exc)[:200])
            await backoff.after(exc)
        await asyncio.sleep(0)
    return False


def _settings_epilog() -> str:
    special = {
        "worker_id": "host-pid-random",
        "channels": "none (comma separated; registered and discovered channels are served too)",
        "owner_ttl_ms": "max(15000, 1.5 x AGENT_LOCK_TTL_MS)",
    }
    lines = ["all settings (environment):"]
    for name, field in Settings.model_fields.items():
        value = field.default_factory() if field.default_factory is not None else field.default  # type: ignore[call-arg]
        default = special.get(name, repr(value))
        lines.append(f"  AGENT_{name.upper():<30} default {default}")
    lines.append("  OPENAI_BASE_URL, OPENAI_API_KEY   for AGENT_PROVIDER=openai")
    return "\n".join(lines)


async def run(args: argparse.Namespace, settings: Settings) -> int:
    import asyncio

    from worker.cli.main import redact_url

    setup_logging(settings.log_level, settings.log_format)
    redis = make_redis(settings.redis_url)
    stopped = asyncio.Event()
    aloop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        aloop.add_signal_handler(sig, stopped.set)
    if not await _connect(redis, redact_url(settings.redis_url), stopped):
        await redis.aclose()
        return 0
    loop = make_loop(settings, redis)

    def stop(sig: signal.Signals) -> None:
        log.info(
            "%s: taking no new work, finishing running turns (up to %ss), then stopping",
            sig.name, settings.shutdown_grace_s,
        )  # fmt: skip
        loop.stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        aloop.add_signal_handler(sig, stop, sig)
    collector.tune(settings.gc_young_threshold)
    health = None
    if settings.metrics_port:
        from worker.ops.health import HealthServer, redis_ready

        health = HealthServer(render_metrics=loop.rt.metrics.render, ready=redis_ready(redis))
        await health.start(settings.metrics_host, settings.metrics_port)
    log.info(
        "worker %s started: redis=%s prefix=%s provider=%s concurrency=%d unified=%s",
        loop.worker_id,
        redact_url(settings.redis_url),
        settings.key_prefix,
        settings.provider,
        settings.concurrency,
        settings.unified_session,
    )
    try:
        await loop.run()
    finally:
        if health is not None:
            await health.close()
        await redis.aclose()
    return 0
