"""One WebSocket per page, carrying the events of many chats (as nanobot's web channel).

Client -> server (JSON):  {"op": "subscribe", "session_id": ID, "after": CURSOR?}
                          {"op": "unsubscribe", "session_id": ID}
Server -> client (JSON):  {"type": "subscribed", "session_id", "cursor"}
                          {"type": "event", "session_id", "id", "event": {...}}   (as in SSE)
                          {"type": "gap", "session_id", "id"}
                          {"type": "error", "session_id"?, "message"}
Authentication: ``?ticket=`` (browsers) or an ``Authorization`` header. The resume rule
is the SSE one: ``after`` is the last event id seen; nothing is lost or doubled.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from fastapi import APIRouter, HTTPException, WebSocket, WebSocketDisconnect
from redis.exceptions import RedisError

from gateway.api import public_event, valid_cursor
from gateway.app import Gateway
from gateway.auth import User
from gateway.chats import Chat
from gateway.hub import TooManyStreamsError
from gateway.subscription import event_size

router = APIRouter()
MAX_SUBSCRIPTIONS = 64  # per socket
MAX_FRAME = 4096  # bytes of a client frame
OUTBOX = 512  # frames queued for a slow client before it is disconnected
OUTBOX_BYTES = 4 << 20  # ... or bytes of the events' text they carry
ROOM_WAIT_S = (
    30.0  # a subscription waits this long for a client that reads nothing, then lets it go
)


@router.websocket("/api/ws")
async def socket(ws: WebSocket) -> None:
    gw: Gateway = ws.app.state.gw
    try:
        user = await gw.auth.user(ws, ticket_ok=True)
    except HTTPException as exc:  # accepted first: a close before it is a bare HTTP 403
        await ws.accept()
        if exc.status_code == 429:
            await ws.close(code=4429, reason="too many requests")
        else:
            await ws.close(code=4401, reason="authentication required")
        return
    with gw.socket_slot(user) as admitted:  # (taken before the handshake is answered)
        await ws.accept()
        if not admitted:
            await ws.close(code=4429, reason="too many connections for this user")
            return
        gw.metrics.websockets_open.inc()
        try:
            await Connection(gw, user, ws).serve()
        finally:
            gw.metrics.websockets_open.dec()


class Connection:
    """One socket: a receiving task, a writing task, and a pump per followed chat. A client
    that stops reading (its outbox full) is disconnected; it reconnects and resumes."""

    def __init__(self, gw: Gateway, user: User, ws: WebSocket) -> None:
        self.gw, self.user, self.ws = gw, user, ws
        self.outbox: asyncio.Queue[tuple[dict[str, Any], int]] = asyncio.Queue(OUTBOX)
        self.queued_bytes = 0  # of the queued events' text
        self.pumps: dict[str, asyncio.Task[None]] = {}
        self.overflowed = False
        self.ended = asyncio.Event()
        self.room = asyncio.Event()  # set by the writer each time it took a frame

    async def serve(self) -> None:
        tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._write())]
        try:
            await self.ended.wait()
        finally:
            everything = [*tasks, *self.pumps.values()]
            for task in everything:
                task.cancel()
            await asyncio.gather(*everything, return_exceptions=True)
            if self.overflowed:
                with contextlib.suppress(Exception):
                    await self.ws.close(code=1013, reason="too slow: reconnect and resume")

    def put(self, frame: dict[str, Any], size: int = 0) -> None:
        """Queue ``frame`` (``size``: the bytes of event text it carries); a client this
        far behind is let go."""
        if self.queued_bytes + size > OUTBOX_BYTES:
            self._overflow()
            return
        try:
            self.outbox.put_nowait((frame, size))
        except asyncio.QueueFull:
            self._overflow()
            return
        self.queued_bytes += size

    async def put_in_turn(self, frame: dict[str, Any], size: int) -> None:
        """A subscription's event: it waits for the writer to make room, so a resume's
        catch-up (up to 200 events a read) goes at the pace the client reads; a client
        that takes nothing for ``ROOM_WAIT_S`` is let go as too slow."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ROOM_WAIT_S
        while self.queued_bytes and (self.queued_bytes + size > OUTBOX_BYTES or self.outbox.full()):
            self.room.clear()
            left = deadline - loop.time()
            if left <= 0 or self.ended.is_set():
                self._overflow()
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.room.wait(), left)
        self.put(frame, size)

    def _overflow(self) -> None:
        self.overflowed = True
        self.ended.set()

    async def _receive(self) -> None:
        try:
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    return
                try:  # every frame, as every request (a subscription reads Redis)
                    await self.gw.auth.charge(self.user)
                except HTTPException as exc:
                    self.put({"type": "error", "message": str(exc.detail)})
                    continue
                raw = message.get("text")
                if raw is None:
                    self.put({"type": "error", "message": "text frames only"})
                elif len(raw) > MAX_FRAME:
                    self.put({"type": "error", "message": "frame too large"})
                else:
                    await self._handle(raw)
        except (WebSocketDisconnect, RuntimeError):
            return
        finally:
            self.ended.set()

    async def _write(self) -> None:
        try:
            while True:
                frame, size = await self.outbox.get()
                self.queued_bytes -= size
                self.room.set()
                await self.ws.send_text(json.dumps(frame, ensure_ascii=False))
        except (WebSocketDisconnect, RuntimeError, OSError):
            self.ended.set()
        except BaseException:  # a writer gone for any reason ends the socket, never mutes it
            self.ended.set()
            raise

    async def _handle(self, raw: str) -> None:
        try:
            frame = json.loads(raw)
            op, session_id = frame["op"], str(frame["session_id"])
            after = frame.get("after")
            after = "$" if after is None else after  # (the number 0 was taken for "$")
            session_id.encode("utf-8")  # (a lone surrogate, echoed, killed the writer)
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            self.put({"type": "error", "message": "expected {op, session_id}"})
            return
        if not isinstance(after, str):
            self.put({"type": "error", "session_id": session_id, "message": "after: a string"})
            return
        if op == "unsubscribe":
            task = self.pumps.pop(session_id, None)
            if task is not None:
                task.cancel()
            return
        chat = await self.gw.chats.owned(self.user, session_id)
        if op != "subscribe" or chat is None or not valid_cursor(after):
            self.put(
                {"type": "error", "session_id": session_id, "message": "no such session or op"}
            )
            return
        if session_id not in self.pumps and len(self.pumps) >= MAX_SUBSCRIPTIONS:
            self.put(
                {"type": "error", "session_id": session_id, "message": "too many subscriptions"}
            )
            return
        old = self.pumps.pop(session_id, None)
        if old is not None:  # ended before the new one starts: its stream slot is free
            old.cancel()
            await asyncio.gather(old, return_exceptions=True)
        task = asyncio.create_task(self._pump(chat, after))
        self.pumps[session_id] = task
        task.add_done_callback(lambda t: self._ended_pump(session_id, t))

    def _ended_pump(self, session_id: str, task: asyncio.Task[None]) -> None:
        if self.pumps.get(session_id) is task:  # a pump that ended frees its slot
            del self.pumps[session_id]

    async def _pump(self, chat: Chat, after: str) -> None:
        try:
            async with self.gw.subscribe(self.user, chat, after) as sub:
                self.put({"type": "subscribed", "session_id": chat.id, "cursor": sub.cursor})
                async for ev in sub.events(self.gw.settings.keepalive_s):
                    if ev is None:
                        continue
                    if ev.kind == "gap":
                        self.put({"type": "gap", "session_id": chat.id, "id": ev.entry_id})
                    elif ev.event is not None:
                        await self.put_in_turn(
                            {
                                "type": "event",
                                "session_id": chat.id,
                                "id": ev.entry_id,
                                "event": public_event(chat, ev.event),
                            },
                            event_size(ev),
                        )
        except TooManyStreamsError as exc:
            self.put({"type": "error", "session_id": chat.id, "message": str(exc)})
        except (RedisError, OSError):
            message = "events unavailable; subscribe again to resume"
            self.put({"type": "error", "session_id": chat.id, "message": message})
