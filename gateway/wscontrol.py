"""WebSocket control frames, which the server answers below the app.

uvicorn answers a client's ``PING`` with a ``PONG`` itself, before the app sees anything:
gateway.ratelimit never charges them. One authenticated socket sending empty pings as
fast as it could took the replica's core (another user's p50 went from ~5 ms to 11-21 s),
and one that never read the pongs made the replica hold every one of them (+280 MB in 10
s). :class:`ControlFrameCap` is uvicorn's own protocol but for that: a socket that sends
more than ``MAX_CONTROL_PER_S`` control frames a second, or leaves more than
``MAX_UNREAD_BYTES`` of answers unread, is dropped (the app sees a disconnect). Browsers
send no pings; other clients ping every few seconds at most.
"""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger(__name__)

MAX_CONTROL_PER_S = 20  # PING and PONG frames a second, per socket
MAX_UNREAD_BYTES = 1 << 20  # answers written but not read by the client

try:  # uvicorn >= 0.35 (the gateway extra asks for it): its websockets sans-I/O protocol
    from uvicorn.protocols.websockets.websockets_sansio_impl import (
        WebSocketsSansIOProtocol as _Base,
    )
except ImportError:  # pragma: no cover
    _Base = None  # type: ignore[assignment,misc]


def protocol() -> Any:
    """The ``ws`` argument for uvicorn: the capped protocol, or "auto" where this uvicorn
    has no sans-I/O protocol to extend (then control frames are not capped)."""
    if _Base is None:  # pragma: no cover
        log.warning("uvicorn without its websockets sans-I/O protocol: pings are not capped")
        return "auto"
    return ControlFrameCap


if _Base is not None:

    class ControlFrameCap(_Base):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._window = 0  # the second the count is of
            self._controls = 0

        def handle_ping(self) -> None:
            if self._over():
                return
            super().handle_ping()

        def handle_pong(self, event: Any) -> None:
            if self._over():
                return
            super().handle_pong(event)

        def _over(self) -> bool:
            """Counts a control frame; True (the socket dropped) past the caps."""
            second = int(time.monotonic())
            if second != self._window:
                self._window, self._controls = second, 0
            self._controls += 1
            unread = self.transport.get_write_buffer_size()
            if self._controls <= MAX_CONTROL_PER_S and unread <= MAX_UNREAD_BYTES:
                return False
            if not self.transport.is_closing():
                log.warning(
                    "dropped a WebSocket of %s: %d control frames this second, %d bytes unread",
                    self.client, self._controls, unread,
                )  # fmt: skip
                self.transport.abort()
            return True
