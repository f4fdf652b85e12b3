"""Building a worker from Settings: Redis client, provider, AgentLoop."""

from __future__ import annotations

import os

import redis.asyncio as aioredis
from redis import Redis as SyncRedis

from bus_redis import RedisBus
from bus_redis.server_watch import ServerWatch
from worker.agent.providers import EchoProvider, GenerationSettings, LLMProvider, OpenAIProvider
from worker.ops.metrics import MeteredProvider, WorkerMetrics
from worker.runtime.loop import AgentLoop
from worker.runtime.packing import use_hiredis_packing
from worker.settings import Settings

DEFAULT_OPENAI_MODEL = "gpt-4o-mini"


def make_redis(url: str) -> aioredis.Redis:
    """The worker's client. A command that fails on a lost connection is not retried by the
    client (its caller decides: the worker's loops back off and try again, the scripts are
    idempotent under a retry); the next command connects again. (A redis-py ``Retry`` used
    to be set here, but the sync one, which asyncio clients do not await: it never retried.)
    """
    client = aioredis.from_url(
        url,
        decode_responses=True,
        health_check_interval=10,
        socket_connect_timeout=2,
    )
    # before its first connection: every one of them tells which server it reached
    ServerWatch.of(client.connection_pool)
    return use_hiredis_packing(client)


def make_provider(settings: Settings) -> LLMProvider:
    generation = GenerationSettings(
        temperature=settings.temperature, max_tokens=settings.max_tokens
    )
    if settings.provider == "echo":
        echo = EchoProvider(settings.model or "echo-1")
        echo.generation = generation
        return echo
    return OpenAIProvider(
        settings.model or DEFAULT_OPENAI_MODEL,
        base_url=os.environ.get("OPENAI_BASE_URL", "").strip() or None,  # '' = the default
        api_key=os.environ.get("OPENAI_API_KEY") or None,
        timeout_s=settings.provider_timeout_s,
        deadline_s=settings.provider_deadline_s,
        max_retries=settings.provider_retries,
        generation=generation,
    )


def make_loop(
    settings: Settings, redis: aioredis.Redis, provider: LLMProvider | None = None
) -> AgentLoop:
    from worker.jobs.arq_queue import ArqJobQueue

    jobs = ArqJobQueue(settings.redis_url, settings.key_prefix) if settings.jobs == "arq" else None
    bus = RedisBus(redis, settings.key_prefix)  # timings come from the loop's config
    metrics = WorkerMetrics()
    loop = AgentLoop(
        bus,
        MeteredProvider(provider or make_provider(settings), metrics),
        model=settings.model or None,
        jobs=jobs,
        config=settings.loop_config(),
    )
    loop.rt.metrics = metrics
    # the liveness beat runs in a thread on a connection of its own (worker/runtime/liveness.py)
    loop.liveness.beat_client = SyncRedis.from_url(
        settings.redis_url, socket_timeout=2, socket_connect_timeout=2
    )
    return loop
