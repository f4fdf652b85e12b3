"""Runtime: the narrow context a worker's parts share (instead of the whole AgentLoop).

Holders, turn executions, maintenance and consolidation read what they need from here;
per-turn state goes through ``turns`` (its one owner). Nothing below ``worker.runtime.loop``
imports it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import RedisError

from bus_redis import RedisBus
from bus_redis.registry import Registry
from bus_redis.server_watch import ServerWatch
from session_store import OWNER_SCOPE, MemoryStore, RedisSessionStore, Session, SessionManager
from worker.agent.prompt import IDENTITY, ContextBuilder
from worker.agent.providers import LLMProvider
from worker.agent.runner import TurnRunner
from worker.agent.tools import ToolRegistry, default_registry
from worker.agent.tools.base import Services
from worker.config import LoopConfig
from worker.jobs import JobQueue, LocalJobQueue
from worker.ops.metrics import WorkerMetrics
from worker.runtime.inflight import TurnRegistry

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Runtime:
    config: LoopConfig
    bus: RedisBus
    registry: Registry
    sessions: SessionManager
    memory: MemoryStore
    provider: LLMProvider
    runner: TurnRunner
    jobs: JobQueue
    model: str
    turns: TurnRegistry
    # queues a consolidation job when a committed session is over budget (Consolidator)
    maybe_consolidate: Callable[[Session], Awaitable[Any]] = field(default=lambda _s: _noop())
    # looks for a control's marker after K's running entry, then cancels (AgentLoop's
    # Controls: in the pass that looks again when Redis failed it)
    look: Callable[[str], None] = field(default=lambda _k: None)
    services: Services | None = None  # subagents and schedules (worker.jobs)
    background: set[asyncio.Task[Any]] = field(default_factory=set)
    claim: str = ""  # what this process claimed its worker id with (check_can_serve)
    # the id was claimed by another process (host, pid) while this one was stopped
    on_id_taken: Callable[[str, str], None] = field(default=lambda _h, _p: None)
    metrics: WorkerMetrics = field(default_factory=WorkerMetrics)
    # more to do when Redis is another server than before (the liveness watch's streak)
    on_new_server: list[Callable[[], None]] = field(default_factory=list)

    @classmethod
    def build(
        cls,
        config: LoopConfig,
        bus: RedisBus,
        provider: LLMProvider,
        *,
        sessions: SessionManager | None,
        memory: MemoryStore | None,
        model: str | None,
        tools: ToolRegistry | None,
        jobs: JobQueue | None,
    ) -> Runtime:
        """A worker's runtime from its config; each part given is used as it is (tests,
        embedding), each other one made from the config: Redis-backed sessions with the
        bus' fast connection, the tools the config allows, the prompt built once for them."""
        chosen = (tools or default_registry()).chosen(config.tools_allow, config.tools_deny)
        context = ContextBuilder(
            chosen.names,
            identity=config.system_prompt or IDENTITY,
            history_tokens=config.history_tokens,
        )
        model = model or provider.get_default_model()
        if sessions is None:
            store = RedisSessionStore(
                bus.redis, bus.keys, lock_ttl_ms=bus.lock_ttl_ms, fast=bus.fast
            )
            sessions = SessionManager(
                store,
                cache_size=config.session_cache_sessions,
                cache_rows=config.session_cache_rows,
                cache_chars=config.session_cache_chars,
            )
        rt = cls(
            config=config,
            bus=bus,
            registry=Registry(bus),
            sessions=sessions,
            memory=memory or MemoryStore(bus.redis, bus.keys),
            provider=provider,
            runner=TurnRunner(provider, chosen, context, model, config.max_iterations),
            jobs=jobs or LocalJobQueue(),
            model=model,
            turns=TurnRegistry(),
        )
        # a restart or failover may bring back older contents: every connection that
        # reaches another server drops the copies before it answers anything
        watch = ServerWatch.of(bus.redis.connection_pool)  # (make_redis attached it)
        watch.on_new_server = rt.new_server
        if bus.fast is not None:
            bus.fast.server_watch = watch
        return rt

    def new_server(self) -> None:
        """Redis came back as another server (restarted, failed over): what it holds may be
        older than what this worker saw, at the same versions. Copies of stored sessions and
        memories go (the next turns read them again), and so does what else was registered
        in ``on_new_server``."""
        log.warning("Redis is another server than before: cached sessions and memory dropped")
        self.sessions.forget_stored()
        self.memory.forget_cached()
        for hook in self.on_new_server:
            hook()

    @property
    def tools(self) -> ToolRegistry:
        """The tools this worker offers (those the config allows)."""
        return self.runner.tools

    def spawn(self, coro: Awaitable[Any]) -> None:
        """Run ``coro`` in the background, keeping a reference until it is done."""
        task: asyncio.Task[Any] = asyncio.ensure_future(coro)
        self.background.add(task)
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self.background.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.warning("background task failed: %s", type(exc).__name__)

    @property
    def worker_id(self) -> str:
        return self.config.worker_id

    def scope_for(self, channel: str, vouched: str | None, sender_id: str) -> str:
        """The scope a message asks for: the frontend's vouched scope within its channel,
        else its sender alone (two senders never share a scope by accident); one scope
        for everything in single-owner mode."""
        if self.config.owner_mode:
            return OWNER_SCOPE
        # separate namespaces: a vouched name can never equal someone's default scope
        return f"{channel}/scope:{vouched}" if vouched else f"{channel}/sender:{sender_id}"

    async def drop_owner(self, key: str, member: str, *, later: bool = True) -> None:
        """Drop the owner record of a private session this worker has forgotten; a drop
        that fails is retried (each tick, and before any acquire of the key), so that no
        record is left naming a worker that holds no such session. ``later=False``: a
        failure is raised instead (the caller must not go on without the drop)."""
        if self.turns.owns(key):  # opened again here meanwhile: the record is its own
            self.turns.dropped(key)
            return
        try:
            await self.registry.drop_owner(key, self.worker_id, member)
        except (RedisError, OSError) as exc:
            if not later:
                raise
            if not self.turns.owns(key):
                log.warning("dropping an owner record failed (%s): retried", type(exc).__name__)
                self.turns.redrop(key, member)
            return
        self.turns.dropped(key)

    def forget(self, key: str) -> None:
        """Drop a session from this worker's memory (discard, lost ownership)."""
        self.sessions.invalidate(key)
        self.turns.disown(key)

    def lost(self, key: str) -> None:
        """A private session whose owner record ran out under this worker (its renewals
        failed, or it stalled): a turn running on it is cancelled, so that no answer comes
        after the ``session_lost`` the owners' sweep writes, and it is forgotten."""
        log.warning("owner record of a transient session expired; session dropped")
        running = self.turns.running().get(key)
        if running is not None:
            self.turns.cancel_entry(key, running[1], "discard")
        self.forget(key)


async def _noop() -> None:
    return None
