"""Frontend subcommands: ``send``, ``chat``, ``discard``, ``stop``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import threading
import uuid
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from bus_redis import FrontendClient, InboundMessage, OutboundMessage
from bus_redis.keys import channel_of, in_channel, valid_channel
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

    p = sub.add_parser(
        "chat",
        help="interactive chat (/help: /temp, /durable, /new, /stop, /discard, /quit)",
        description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common(p)
    p.add_argument("--channel", default="cli")
    p.add_argument("--chat-id", default="me")
    p.add_argument(
        "--wait", type=float, default=120.0, metavar="S",
        help="at the end, wait this long for answers on their way (default 120)",
    )  # fmt: skip
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
        try:
            msg = InboundMessage(
                id=args.id or uuid.uuid4().hex,
                channel=args.channel,
                sender_id="cli",
                chat_id=args.chat_id,
                content=args.text,
                session_key_override=args.session,
                require_existing_session=args.require_existing,
            )
        except ValidationError as exc:
            first = exc.errors()[0]
            print(f"agent-worker: invalid message: {first['msg']}", file=sys.stderr)
            return 2
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
    channel = channel_of(args.session_key)
    if not valid_channel(channel) or not in_channel(args.session_key, channel):
        print(
            f"agent-worker: {args.session_key!r} is no session key (CHANNEL:CHAT, the "
            f"channel of letters, digits, '_' and '-')",
            file=sys.stderr,
        )
        return 2
    redis = make_redis(settings.redis_url)
    try:
        receivers = await FrontendClient(redis, settings.key_prefix).control(
            args.op, args.session_key
        )
        print(f"{args.op} sent for {args.session_key} ({receivers} workers listening)")
        return 0
    finally:
        await redis.aclose()


HELP = """commands:
  /temp      open a private session (never stored; gone when discarded or its worker leaves)
  /durable   back to the stored chat
  /new       start a fresh conversation (the previous one is summarised into memory;
             in a private session: discard it)
  /stop      stop the running turn (messages queued before it are cancelled too)
  /discard   forget the current session (a private one is gone; a stored one keeps its history)
  /help      this list
  /quit      leave (after the replies on their way arrived; also at end of input or Ctrl-C)
anything else is sent as a message"""


class _Chat:
    """One terminal's chat: a session to send to, and the replies of the sessions it sent
    to (the current one, and an earlier one while answers to it are on their way: a
    switch never hides an answer), each message waited for before leaving."""

    def __init__(self, client: FrontendClient, channel: str, chat_id: str) -> None:
        self.client = client
        self.channel = channel
        self.base_chat = chat_id
        self.chat_id = chat_id
        self.transient: str | None = None
        self.waiting: dict[str, set[str]] = {}  # session -> ids of messages not answered yet
        self.answered = asyncio.Event()
        self.printers: dict[str, asyncio.Task[None]] = {}
        self._streaming = False

    @property
    def session_key(self) -> str:
        return self.transient or f"{self.channel}:{self.chat_id}"

    @property
    def pending(self) -> int:
        return sum(len(ids) for ids in self.waiting.values())

    def follow(self, session_key: str, after: str = "$") -> None:
        if session_key not in self.printers or self.printers[session_key].done():
            self.printers[session_key] = asyncio.create_task(self._print(session_key, after))

    def settle(self) -> None:
        """Stop following sessions that are neither current nor awaited."""
        for key in list(self.printers):
            if key != self.session_key and not self.waiting.get(key):
                self.printers.pop(key).cancel()

    async def close(self) -> None:
        tasks = list(self.printers.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def show(self, ev: OutboundMessage) -> None:
        if ev.type == "delta":
            print(ev.content or "", end="", flush=True)
            self._streaming = True
            return
        streamed, self._streaming = self._streaming, False
        if streamed:
            print(flush=True)
        if ev.type == "message" and streamed and ev.metadata.get("event") is None:
            self._terminal(ev)  # the streamed text was the answer: not printed twice
            return
        if ev.type == "error" and ev.code == "session_lost":
            print(f"[error session_lost] {ev.content}")
            print(
                "[the private session is gone: /durable goes back to the stored chat, "
                "/temp opens a new one]"
            )
        else:
            _print_event(ev)
        self._terminal(ev)

    def _terminal(self, ev: OutboundMessage) -> None:
        if not ev.is_terminal:
            return
        ids = self.waiting.get(ev.session_key or "", set())
        if ev.is_loss_notice:  # the session's unread answers went with it: none to wait for
            ids.clear()
        for rid in [ev.reply_to, *(ev.covers or [])]:
            ids.discard(rid or "")
        self.answered.set()

    async def _print(self, session_key: str, after: str) -> None:
        """Events of one session this window sent to (another window's never show here)."""
        events = self.client.events([session_key], after=after)
        private = session_key.startswith(f"{self.channel}:{self.base_chat}-private-")
        async with contextlib.aclosing(events):  # type: ignore[type-var]
            async for ev in events:
                self.show(ev)
                if private and ev.entry_id:  # a private session's events go once shown
                    await self.client.redis.xdel(self.client.keys.out(session_key), ev.entry_id)
                if session_key != self.session_key and not self.waiting.get(session_key):
                    return  # an earlier session: its last awaited answer came

    async def drain(self, timeout_s: float) -> bool:
        """Wait for the answers still on their way; False when some did not come."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.pending and loop.time() < deadline:
            self.answered.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.answered.wait(), deadline - loop.time())
        return not self.pending

    async def handle(self, line: str) -> bool:
        if line in ("/quit", "/exit"):
            return False
        if line == "/help":
            print(HELP)
        elif line == "/temp":
            key = f"{self.channel}:{self.base_chat}-private-{uuid.uuid4().hex[:6]}"
            self.transient, _ = await self.client.open_transient(
                self.channel, self.base_chat, session_key=key
            )
            print(f"[now in private session {self.transient}: nothing of it is stored]")
        elif line == "/durable":
            self.transient = None
            print(f"[back to {self.session_key}]")
        elif line == "/new":
            key = self.session_key
            if self.transient is not None:  # a private session's new is its discard: said
                await self.client.discard(key)  # so, never a `new` a worker could apply to
                self.transient = None  # a shared session once the private one has ended
                print(f"[private session {key} discarded; back to {self.session_key}]")
            else:
                await self.client.new(key)
                print(f"[new conversation in {key}: the previous one goes into long-term memory]")
        elif line in ("/stop", "/discard"):
            op, key = line[1:], self.session_key
            await self.client.control(op, key)
            if op == "stop":
                print(f"[stop sent for {key}]")
            elif self.transient is not None:
                self.transient = None
                print(f"[private session {key} discarded; back to {self.session_key}]")
            else:
                print(
                    f"[discard sent for {key}: workers forget their copy; its history stays stored]"
                )
        elif line.startswith("/"):
            print(f"[unknown command {line.split()[0]}; /help lists them]")
        elif line:
            msg_id = uuid.uuid4().hex
            self.waiting.setdefault(self.session_key, set()).add(msg_id)
            await self.client.send(
                InboundMessage(
                    id=msg_id,
                    channel=self.channel,
                    sender_id="cli",
                    chat_id=self.base_chat if self.transient else self.chat_id,
                    content=line,
                    session_key_override=self.transient,
                    require_existing_session=self.transient is not None,
                )
            )
        return True


def _stdin_lines() -> asyncio.Queue[str]:
    """Lines of stdin ('' at its end), read by a daemon thread: a chat that ends (Ctrl-C,
    /quit) never waits for a read that may block for ever."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[str] = asyncio.Queue()

    def read() -> None:
        while True:
            line = sys.stdin.readline()
            loop.call_soon_threadsafe(queue.put_nowait, line)
            if not line:
                return

    threading.Thread(target=read, name="stdin", daemon=True).start()
    return queue


async def chat(args: argparse.Namespace, settings: Settings) -> int:
    redis = make_redis(settings.redis_url)
    await redis.ping()
    session = _Chat(FrontendClient(redis, settings.key_prefix), args.channel, args.chat_id)
    session.follow(session.session_key)
    interactive = sys.stdin.isatty()
    with contextlib.suppress(AttributeError, ValueError):  # each line as it comes, piped too
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    lines = _stdin_lines()
    print(f"chatting as {session.session_key}; /help lists the commands, /quit leaves")
    try:
        while True:
            if interactive:
                print("> ", end="", flush=True)
            try:
                line = await lines.get()
            except (KeyboardInterrupt, asyncio.CancelledError):
                break
            before = session.session_key
            if not line or not await session.handle(line.strip()):
                break
            if session.session_key != before:  # /temp, /durable, /new, /discard: follow it
                # a new private session: all of it (its opening is answered there)
                session.follow(session.session_key, "0" if session.transient else "$")
                session.settle()
        if session.pending and not await session.drain(args.wait):
            print(f"[{session.pending} answers did not come within {args.wait:g}s]")
    finally:
        await session.close()
        await redis.aclose()
    return 0
