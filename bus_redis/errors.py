"""Errors raised by the bus layer.

BusError
 ├── BusConnectionError      Redis unreachable / connection dropped (translated at the edge)
 ├── LeaseLostError          a fenced write was rejected: the lease is no longer ours
 └── MessageRejectedError    an inbound payload failed decoding/validation (carries an error code)
"""

from __future__ import annotations


class BusError(Exception):
    """Base class of the bus layer's errors."""


class BusConnectionError(BusError):
    """Redis could not be reached."""


class LeaseLostError(BusError):
    """A fenced write was rejected because this worker no longer holds the session lease."""


class MessageRejectedError(BusError):
    """An inbound payload cannot be processed.

    ``code`` is the outbound error code (``invalid_message`` or ``too_large``);
    ``channel`` / ``chat_id`` are set when the origin could be read from the payload.
    """

    def __init__(
        self,
        code: str,
        detail: str,
        *,
        channel: str | None = None,
        chat_id: str | None = None,
        session_key: str | None = None,
        message_id: str | None = None,
    ) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail
        self.channel = channel
        self.chat_id = chat_id
        self.session_key = session_key
        self.message_id = message_id
