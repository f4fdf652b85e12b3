"""``agent-worker demo``: an embedded Redis, two workers, a short scripted conversation."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError

from bus_redis import FrontendClient, InboundMessage, OutboundMessage
from worker.app import make_loop, make_redis
from worker.runtime.loop import AgentLoop
from worker.settings import Settings

CHANNEL = "demo"


def register(sub: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser(
        "demo",
        help="run the embedded demo (own Redis, two workers, the echo provider, or the openai "
        "one when OPENAI_API_KEY is set)",
    )
    p.add_argument(
        "--keep",
        action="store_true",
        help="keep Redis and the workers running afterwards, with the gateway and its chat page",
    )
    p.set_defaults(handler=demo)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def embedded_redis() -> Iterator[tuple[str, str]]:
    """A redis-server on a free port, else an in-process fakeredis TCP server."""
    port = _free_port()
    binary = shutil.which("redis-server")
    if binary:
        workdir = tempfile.mkdtemp(prefix="agent-demo-")
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", workdir],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            _wait_port(port)
            yield f"redis://127.0.0.1:{port}/0", f"redis-server {binary}"
        finally:
            proc.terminate()
            proc.wait(timeout=10)
            shutil.rmtree(workdir, ignore_errors=True)
        return
    try:
        from fakeredis import TcpFakeServer
    except ImportError:
        raise SystemExit(
            "agent-worker demo: no redis-server found; install it (apt-get install redis-server) "
            "or pip install 'redis-agent-worker[demo]' for the in-process server"
        ) from None
    server = TcpFakeServer(("127.0.0.1", port), server_type="redis")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"redis://127.0.0.1:{port}/0", "in-process fakeredis (no redis-server installed)"
    finally:
        server.shutdown()


def _wait_port(port: int, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with (
            contextlib.suppress(OSError),
            socket.create_connection(("127.0.0.1", port), timeout=0.2),
        ):
            return
        time.sleep(0.05)
    raise SystemExit("agent-worker demo: redis-server did not start")


class _Script:
    def __init__(self, client: FrontendClient) -> None:
        self.client = client

    async def say(self, chat_id: str, text: str, *, session: str | None = None) -> OutboundMessage:
        msg = InboundMessage(
            id=uuid.uuid4().hex,
            channel=CHANNEL,
            sender_id="demo-user",
            chat_id=chat_id,
            content=text,
            session_key_override=session,
            require_existing_session=session is not None,
        )
        print(f"  you  > {text}")
        ev = await self.client.ask(msg, timeout_s=60)
        who = f"    (worker {ev.metadata['worker']})" if "worker" in ev.metadata else ""
        shown = ev.content if ev.type == "message" else f"[{ev.code}] {ev.content}"
        print(f"  bot  < {shown}{who}")
        return ev

    async def opened(self, key: str, reply_to: str) -> None:
        async for ev in self.client.events([key], after="0"):
            if ev.reply_to == reply_to and ev.is_terminal:
                return


async def _conversation(script: _Script, loops: list[AgentLoop], redis_url: str) -> None:
    client = script.client
    print("\n1. A durable session: two turns, stored in one Redis hash")
    await script.say("alice", "Hello! My name is Ada.")
    await script.say("alice", "What did I just tell you?")
    stored = await loops[0].sessions.read_session(f"{CHANNEL}:alice")
    print(
        f"  stored history of {CHANNEL}:alice: {len(stored['messages']) if stored else 0} messages"
    )

    print("\n2. A private (transient) session: lives only in its owner's memory")
    key, opened = await client.open_transient(
        CHANNEL,
        "alice",
        session_key=f"{CHANNEL}:alice-private",
        disabled_tools={"create_goal", "update_goal"},
    )
    await asyncio.wait_for(script.opened(key, opened), 30)
    owner = next(loop.worker_id for loop in loops if loop.sessions.is_transient(key))
    print(f"  opened {key}, owned by worker {owner}")
    await script.say("alice", "A secret only this worker may know.", session=key)
    leaked = [k async for k in client.redis.scan_iter() if "secret" in str(await _value(client, k))]
    print(f"  Redis keys holding the secret: {len(leaked)}")

    print("\n3. Discard it from anywhere: the session is gone for good")
    await client.discard(key)
    await script.say("alice", "Are you still there?", session=key)
    print(
        f"\nTry it yourself: agent-worker chat --redis-url {redis_url} --prefix demo "
        f"--channel {CHANNEL} (with demo --keep)"
    )


async def _serve_page(url: str) -> None:
    """The gateway and its chat page beside the demo's workers, until interrupted."""
    try:
        import uvicorn

        from gateway.app import create_app
        from gateway.settings import GatewaySettings
    except ImportError:  # installed without the [gateway] extra
        print("running; Ctrl-C to stop (install the [gateway] extra for the chat page)")
        await asyncio.Event().wait()
        return
    token = uuid.uuid4().hex
    port = _free_port()
    settings = GatewaySettings(
        redis_url=url, key_prefix="demo", channel=CHANNEL, port=port, tokens={token: "you"}
    )
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        proxy_headers=False,
        ws_max_size=64 * 1024,
    )
    print(f"\nChat page: http://127.0.0.1:{port}/  (access token: {token}); Ctrl-C to stop")
    await uvicorn.Server(config).serve()


async def _value(client: FrontendClient, key: str) -> object:
    kind = await client.redis.type(key)
    if kind == "hash":
        return await client.redis.hgetall(key)  # type: ignore[misc]
    if kind == "stream":
        return await client.redis.xrange(key)
    if kind == "string":
        return await client.redis.get(key)
    return ""


async def demo(args: argparse.Namespace, settings: Settings) -> int:
    """SIGTERM / SIGINT end it cleanly: workers stopped, the embedded Redis shut down."""
    task = asyncio.current_task()
    aloop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        aloop.add_signal_handler(sig, task.cancel)  # type: ignore[union-attr]
    try:
        return await _demo(args, settings)
    except asyncio.CancelledError:
        print("demo stopped; its Redis is shut down")
        return 0


async def _demo(args: argparse.Namespace, settings: Settings) -> int:
    provider = "openai" if os.environ.get("OPENAI_API_KEY") else "echo"
    with embedded_redis() as (url, kind):
        print(f"Redis: {kind} at {url}; provider: {provider}; two workers")
        base = settings.model_copy(
            update={
                "redis_url": url,
                "key_prefix": "demo",
                "provider": provider,
                "jobs": "local",
                "channels": [CHANNEL],
            }
        )
        clients = [make_redis(url) for _ in range(3)]
        loops = [
            make_loop(base.model_copy(update={"worker_id": f"demo-worker-{i + 1}"}), clients[i])
            for i in range(2)
        ]
        runs = [asyncio.create_task(loop.run()) for loop in loops]
        script = _Script(FrontendClient(clients[2], "demo"))
        try:
            await _conversation(script, loops, url)
            if args.keep:
                await _serve_page(url)
        except TimeoutError:  # (an OSError: not a Redis that went away)
            print("agent-worker demo: a turn got no answer in time", file=sys.stderr)
            return 1
        except (RedisConnectionError, OSError) as exc:  # its own Redis, not the configured one
            print(f"agent-worker demo: lost its Redis at {url}: {exc}", file=sys.stderr)
            return 1
        finally:
            for loop in loops:
                loop.stop()
            await asyncio.gather(*runs, return_exceptions=True)
            for c in clients:
                await c.aclose()
    return 0
