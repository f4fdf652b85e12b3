"""Errors raised by the bus layer.

BusError
 ├── MessageRejectedError    an inbound payload failed decoding/validation (carries an error code)
 └── SessionBusyError        a `reject` message found its session busy: nothing was queued

Redis' own errors (``redis.exceptions``) are not wrapped: the worker retries them with
backoff, and the CLI turns them into one line at its edge.
"""

from __future__ import annotations


class BusError(Exception):
    """Base class of the bus layer's errors."""


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


class SessionBusyError(BusError):
    """A message sent with ``followup="reject"`` found a message of its session queued or
    being answered: it was not queued (error code ``busy``)."""

    code = "busy"

    def __init__(self, session_key: str) -> None:
        super().__init__(f"busy: session {session_key!r} is answering another message")
        self.session_key = session_key
