"""A TCP proxy between one worker and a redis-server, for tests: what crosses it can be
held (``open``, a gate: a stalled network) or cut for good (``cut()``: Redis sees the
worker as a kill -9 leaves it; a connection being made at that moment is refused too)."""

from __future__ import annotations

import asyncio


class RedisProxy:
    def __init__(self, port: int) -> None:
        self.port = port
        self.open = asyncio.Event()
        self.open.set()
        self.dead = False
        self.writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"redis://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/0"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.dead:
            writer.transport.abort()
            return
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.port)
        self.writers += [writer, up_w]
        if self.dead:  # (cut while this connection was being made)
            self.cut()
            return

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    await self.open.wait()
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer))

    def cut(self) -> None:
        self.dead = True
        self.open.set()
        if self.server is not None:
            self.server.close()
        for writer in self.writers:
            writer.transport.abort()

    async def close(self) -> None:
        self.open.set()
        if self.server is not None:
            self.server.close()
