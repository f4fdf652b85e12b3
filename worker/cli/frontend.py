"""Frontend subcommands: ``send``, ``chat``, ``discard``, ``stop``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import uuid
from collections.abc import Callable
from typing import Any

from bus_redis import FrontendClient, InboundMessage, OutboundMessage
from worker.app import make_redis
from worker.settings import Settings


def register(sub: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser("send", help="publish one message and print the reply")
    common(p)
    p.add_argument("text")
    p.add_argument("--channel", default="cli")
    p.add_argument("--chat-id", default="me")
    p.add_argument("--session", help="session_key_override")
    p.add_argument("--require-existing", action="store_true", help="require_existing_session")
    p.add_argument("--id", help="client message id (idempotency)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the reply")
    p.set_defaults(handler=send)

    p = sub.add_parser("chat", help="interactive chat (/temp, /durable, /stop, /discard, /quit)")
    common(p)
    p.add_argument("--channel", default="cli")
    p.add_argument("--chat-id", default="me")
    p.set_defaults(handler=chat)

    for op in ("discard", "stop"):
        p = sub.add_parser(op, help=f"publish a {op} control for a session")
        common(p)
        p.add_argument("session_key")
        p.set_defaults(handler=control, op=op)


def _print_event(ev: OutboundMessage) -> None:
    if ev.type == "error":
        print(f"[error {ev.code}] {ev.content}")
    elif ev.type == "progress":
        print(f"[progress] {ev.content}")
    elif ev.type == "message" and ev.metadata.get("event") == "transient_opened":
        print(f"[private session {ev.session_key} opened]")
    elif ev.type == "message":
        print(ev.content)


async def send(args: argparse.Namespace, settings: Settings) -> int:
    redis = make_redis(settings.redis_url)
    try:
        client = FrontendClient(redis, settings.key_prefix)
        msg = InboundMessage(
            id=args.id or uuid.uuid4().hex,
            channel=args.channel,
            sender_id="cli",
            chat_id=args.chat_id,
            content=args.text,
            session_key_override=args.session,
            require_existing_session=args.require_existing,
        )
        try:
            ev = await client.ask(msg, timeout_s=args.timeout, on_event=_print_event)
        except TimeoutError:
            print(
                f"agent-worker: no reply within {args.timeout:g}s (is a worker running?)",
                file=sys.stderr,
            )
            return 4
        _print_event(ev)
        return 0 if ev.type == "message" else 3
    finally:
        await redis.aclose()


async def control(args: argparse.Namespace, settings: Settings) -> int:
    redis = make_redis(settings.redis_url)
    try:
        receivers = await FrontendClient(redis, settings.key_prefix).control(
            args.op, args.session_key
        )
        print(f"{args.op} sent for {args.session_key} ({receivers} workers listening)")
        return 0
    finally:
        await redis.aclose()


class _Chat:
    def __init__(self, client: FrontendClient, channel: str, chat_id: str) -> None:
        self.client = client
        self.channel = channel
        self.chat_id = chat_id
        self.transient: str | None = None

    @property
    def session_key(self) -> str:
        return self.transient or f"{self.channel}:{self.chat_id}"

    async def print_replies(self, session_key: str, after: str = "$") -> None:
        """Events of this window's session only (another window's never show here)."""
        events = self.client.events([session_key], after=after)
        private = session_key == self.transient
        async with contextlib.aclosing(events):  # type: ignore[type-var]
            async for ev in events:
                _print_event(ev)
                if private and ev.entry_id:  # a private session's events go once shown
                    await self.client.redis.xdel(self.client.keys.out(session_key), ev.entry_id)

    async def handle(self, line: str) -> bool:
        if line in ("/quit", "/exit"):
            return False
        if line == "/temp":
            key = f"{self.channel}:{self.chat_id}-private-{uuid.uuid4().hex[:6]}"
            self.transient, _ = await self.client.open_transient(
                self.channel, self.chat_id, session_key=key
            )
        elif line == "/durable":
            self.transient = None
            print(f"[back to {self.session_key}]")
        elif line in ("/stop", "/discard"):
            await self.client.control(line[1:], self.session_key)
            if line == "/discard":
                self.transient = None
        elif line:
            await self.client.send(
                InboundMessage(
                    id=uuid.uuid4().hex,
                    channel=self.channel,
                    sender_id="cli",
                    chat_id=self.chat_id,
                    content=line,
                    session_key_override=self.transient,
                    require_existing_session=self.transient is not None,
                )
            )
        return True


async def chat(args: argparse.Namespace, settings: Settings) -> int:
    redis = make_redis(settings.redis_url)
    await redis.ping()
    session = _Chat(FrontendClient(redis, settings.key_prefix), args.channel, args.chat_id)
    printer = asyncio.create_task(session.print_replies(session.session_key))
    print(f"chatting as {session.session_key}; /temp opens a private session, /quit leaves")
    try:
        while True:
            line = await asyncio.to_thread(sys.stdin.readline)
            before = session.session_key
            if not line or not await session.handle(line.strip()):
                break
            if session.session_key != before:  # /temp, /durable, /discard: follow the session
                printer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await printer
                after = "0" if session.transient else "$"  # a new private session: all of it
                printer = asyncio.create_task(session.print_replies(session.session_key, after))
    finally:
        printer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await printer
        await redis.aclose()
    return 0
