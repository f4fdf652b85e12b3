"""Which Redis server a client's connections reach. A (re)connect that finds another
server than before (its ``run_id``: a restart from an older snapshot, a failover to a
replica that lagged) calls back before that connection answers any other command: such a
server may hold the same versions with other contents, so copies of what the old one
held must go (the worker's session and memory caches) before anything read from the new
one is compared with them.

``ServerWatch.of(pool)`` does this for a redis-py pool's connections (the multiplexed
connection, ``bus_redis.mux``, checks its own with the same ``ServerWatch.seen``). It must
be attached before the pool's first connection (``worker.app.make_redis`` does): a
connection made before it is never asked, and the first one asked tells the watch which
server is the current one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from redis.exceptions import ResponseError


def run_id(info: Any) -> str:
    """The ``run_id`` of an ``INFO server`` reply ('' when it has none)."""
    text = info.decode("utf-8", "replace") if isinstance(info, bytes) else str(info)
    for line in text.splitlines():
        if line.startswith("run_id:"):
            return line[7:].strip()
    return ""


class ServerWatch:
    def __init__(self, on_new_server: Callable[[], None] | None = None) -> None:
        self.on_new_server = on_new_server  # set once there is something to drop
        self.server = ""  # the last run_id seen ('' before any, or without INFO)

    @classmethod
    def of(cls, pool: Any) -> ServerWatch:
        """The watch of ``pool``'s connections, attached now if it has none yet."""
        watch = getattr(pool, "_server_watch", None)
        if not isinstance(watch, ServerWatch):
            watch = cls()
            watch.watch(pool)
        return watch

    def seen(self, server: str) -> None:
        """A connection reached ``server`` ('' when it could not tell)."""
        if server and self.server and server != self.server and self.on_new_server:
            self.on_new_server()
        self.server = server or self.server

    def watch(self, pool: Any) -> None:
        """Every connection ``pool`` makes from now on asks its server's ``run_id`` when it
        (re)connects, before it serves a command (redis-py awaits connect callbacks in
        ``connect``). One ``INFO server`` a connect; the pool keeps this watch alive
        (redis-py holds connect callbacks by weak reference)."""
        make = pool.make_connection

        def made() -> Any:
            connection = make()
            connection.register_connect_callback(self._connected)
            return connection

        pool.make_connection = made
        pool._server_watch = self

    async def _connected(self, connection: Any) -> None:
        try:
            await connection.send_command("INFO", "server")
            info = await connection.read_response()
        except ResponseError:  # no INFO (a user without +info): not told apart this time
            return
        self.seen(run_id(info))
