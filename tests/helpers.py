"""Small test doubles: a scripted provider (canned responses) and Redis scans."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis

from worker.agent.providers import GenerationSettings, LLMResponse

Handler = Callable[..., Awaitable[LLMResponse]]


class ScriptedProvider:
    """Answers with canned responses in order, or through ``handler``; records every call."""

    def __init__(
        self, responses: list[str] | None = None, *, handler: Handler | None = None
    ) -> None:
        self.responses = list(responses or [])
        self.handler = handler
        self.calls: list[dict[str, Any]] = []
        self.generation = GenerationSettings()
        self.started = asyncio.Event()

    def get_default_model(self) -> str:
        return "test-model"

    async def chat_with_retry(self, **kwargs: Any) -> LLMResponse:
        self.calls.append(kwargs)
        self.started.set()
        if self.handler is not None:
            return await self.handler(**kwargs)
        if not self.responses:
            raise AssertionError("provider called more often than scripted")
        return LLMResponse(content=self.responses.pop(0), usage={})


async def dump_all(redis: aioredis.Redis) -> str:
    """Every key and value in the database, as one string (to search for leaked content)."""
    parts: list[str] = []
    async for key in redis.scan_iter(count=1000):
        kind = await redis.type(key)
        parts.append(key)
        if kind == "string":
            parts.append(str(await redis.get(key)))
        elif kind == "hash":
            parts.append(str(await redis.hgetall(key)))
        elif kind == "list":
            parts.append(str(await redis.lrange(key, 0, -1)))
        elif kind == "set":
            parts.append(str(await redis.smembers(key)))
        elif kind == "zset":
            parts.append(str(await redis.zrange(key, 0, -1)))
        elif kind == "stream":
            parts.append(str(await redis.xrange(key)))
    return "\n".join(parts)


def run_cli(*argv: str, env: dict[str, str] | None = None) -> Any:
    """``agent-worker ARGV`` in this process (no interpreter start-up per call): a
    ``CompletedProcess``-like result with ``returncode``, ``stdout`` and ``stderr``.
    For commands that end on their own (not ``run`` or ``chat``); from sync tests only."""
    import contextlib
    import io
    import os
    import subprocess

    from worker.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    saved = {name: os.environ.get(name) for name in env or {}}
    os.environ.update(env or {})
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(argv))
            except SystemExit as exc:  # --version, --help, argparse errors
                code = exc.code if isinstance(exc.code, int) else 2
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return subprocess.CompletedProcess(list(argv), code, out.getvalue(), err.getvalue())


def answering(content: str = "ok") -> ScriptedProvider:
    """A provider that answers ``content`` to every call."""

    async def answer(**kw: object) -> LLMResponse:
        return LLMResponse(content=content)

    return ScriptedProvider(handler=answer)


class Gate:
    """An async callable standing in for ``target``: the calls ``when`` picks (all by
    default) set ``reached`` and wait for ``go`` before going on to ``target``; every
    call's arguments are kept in ``calls``. For holding one step of the worker open while
    a test does something in between (never a sleep)."""

    def __init__(
        self, target: Callable[..., Awaitable[Any]], when: Callable[..., bool] | None = None
    ) -> None:
        self.target, self.when = target, when
        self.reached, self.go = asyncio.Event(), asyncio.Event()
        self.calls: list[tuple[Any, ...]] = []

    async def __call__(self, *args: Any, **kw: Any) -> Any:
        self.calls.append(args)
        if self.when is None or self.when(*args, **kw):
            self.reached.set()
            await self.go.wait()
        return await self.target(*args, **kw)

    async def wait_reached(self, timeout_s: float = 10) -> None:
        await asyncio.wait_for(self.reached.wait(), timeout_s)


def opening_commit(*args: Any, **kw: Any) -> bool:
    """``Gate`` ``when`` for ``RedisBus.commit``: the commit that opens a private session
    (it writes the owner record)."""
    return bool(args[3].owner_op == "set")


def hold_opening_commit(loop: Any) -> Gate:
    """Hold ``loop``'s commit that opens a private session (``Gate.go`` lets it on)."""
    held = Gate(loop.bus.commit, when=opening_commit)
    loop.bus.commit = held
    return held


class Spawner:
    """A model that spawns on "research ..." (the rest of the text is the task); a
    subagent (its prompt starts with "Task") answers "found: 42"."""

    def __init__(self, label: str = "r") -> None:
        self.label = label
        self.spawns = 0
        self.subagent_runs = 0

    async def __call__(self, **kw: Any) -> LLMResponse:
        from worker.agent.providers import ToolCallRequest

        last = kw["messages"][-1]
        if last["role"] == "user" and last["content"].startswith("research"):
            self.spawns += 1
            task = last["content"].removeprefix("research").strip()
            args = {"task": task, "label": self.label}
            return LLMResponse(tool_calls=[ToolCallRequest(f"c{self.spawns}", "spawn", args)])
        if last["role"] == "user" and last["content"].startswith("Task"):
            self.subagent_runs += 1
            return LLMResponse(content="found: 42")
        return LLMResponse(content=f"re: {last['content']}")


def held_jobs(loop: Any, name: str) -> list[dict[str, Any]]:
    """The keyword arguments of every job named ``name`` that ``loop`` queues from now
    on, held instead of run (a test runs them: ``loop.subagents.run_job(...)``)."""
    queued: list[dict[str, Any]] = []
    enqueue = loop.jobs.enqueue

    async def hold(job: str, **kw: Any) -> bool:
        if job == name:
            queued.append(kw)
            return True
        return bool(await enqueue(job, **kw))

    loop.jobs.enqueue = hold
    return queued
