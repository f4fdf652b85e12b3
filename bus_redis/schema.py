"""Wire protocol v1: the JSON documents frontends and workers exchange (SPEC 2)."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from bus_redis.errors import MessageRejectedError

WIRE_VERSION = 1
DEFAULT_MAX_PAYLOAD_BYTES = 256 * 1024

NonEmpty = Annotated[str, StringConstraints(min_length=1, max_length=4096)]
ErrorCode = Literal[
    "session_not_active",
    "invalid_message",
    "too_large",
    "dead_lettered",
    "cancelled",
    "busy",
    "session_lost",
    "provider_error",
    "internal",
]
SESSION_NOT_ACTIVE = "required session is not active"


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=False, strict=True)

    v: Literal[1] = 1


class InboundMessage(_Wire):
    """A user (or system) message for one session (SPEC 2.1)."""

    id: str | None = None
    channel: NonEmpty
    sender_id: NonEmpty
    chat_id: NonEmpty
    content: str = ""
    media: list[str] = Field(default_factory=list)
    metadata: dict[str, Any] = Field(default_factory=dict)
    session_key_override: NonEmpty | None = None
    require_existing_session: bool = False
    input_role: Literal["user", "system"] | None = None
    timestamp: datetime | None = Field(default=None, strict=False)

    @property
    def session_key(self) -> str:
        return self.session_key_override or f"{self.channel}:{self.chat_id}"

    @property
    def is_user_input(self) -> bool:
        if self.input_role is not None:
            return self.input_role == "user"
        return self.channel != "system"

    def public_metadata(self) -> dict[str, Any]:
        """Metadata without the reserved ``_`` keys (never trusted from a frontend)."""
        return {k: v for k, v in self.metadata.items() if not k.startswith("_")}


class OpenTransient(_Wire):
    """Opens a private session owned by the worker that processes it (SPEC 2.2)."""

    op: Literal["open_transient"]
    id: str | None = None
    channel: NonEmpty
    chat_id: NonEmpty
    sender_id: str = "frontend"
    session_key_override: NonEmpty | None = None
    disabled_tools: list[str] = Field(default_factory=list)

    @property
    def session_key(self) -> str:
        return self.session_key_override or f"{self.channel}:{self.chat_id}"


class ControlMessage(_Wire):
    """A control published on ``P:control`` (SPEC 2.3)."""

    op: Literal["discard", "stop"]
    session_key: NonEmpty


class OutboundMessage(_Wire):
    """A reply or event on ``P:out:<channel>`` (SPEC 2.4)."""

    model_config = ConfigDict(extra="ignore", strict=False)

    type: Literal["message", "delta", "progress", "error"]
    channel: str
    chat_id: str
    session_key: str
    reply_to: str | None = None
    content: str = ""
    metadata: dict[str, Any] = Field(default_factory=dict)
    code: ErrorCode | None = None
    covers: list[str] | None = None

    @property
    def is_terminal(self) -> bool:
        return self.type in ("message", "error")


InboundPayload = InboundMessage | OpenTransient


def _origin(doc: object) -> dict[str, str | None]:
    """Best-effort channel/chat id of a payload that failed validation."""
    if not isinstance(doc, dict):
        return {}

    def text(name: str) -> str | None:
        value = doc.get(name)
        return value if isinstance(value, str) and value else None

    return {
        "channel": text("channel"),
        "chat_id": text("chat_id"),
        "session_key": text("session_key_override"),
        "message_id": text("id"),
    }


def decode_inbound(
    raw: str | bytes, *, max_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
) -> InboundPayload:
    """Parse and validate one inbound payload; raise :class:`MessageRejectedError`."""
    size = len(raw.encode() if isinstance(raw, str) else raw)
    if size > max_bytes:
        origin = _origin(_try_json(raw)) if size <= 16 * max_bytes else {}
        raise MessageRejectedError(
            "too_large", f"payload is {size} bytes, limit {max_bytes}", **origin
        )
    doc = _try_json(raw)
    if doc is _INVALID:
        raise MessageRejectedError("invalid_message", "payload is not valid JSON")
    origin = _origin(doc)
    if not isinstance(doc, dict):
        raise MessageRejectedError("invalid_message", "payload is not a JSON object")
    if doc.get("v", WIRE_VERSION) != WIRE_VERSION:
        raise MessageRejectedError(
            "invalid_message", f"unsupported wire version {doc.get('v')!r}", **origin
        )
    try:
        if doc.get("op") == "open_transient":
            return OpenTransient.model_validate(doc)
        if "op" in doc:
            raise MessageRejectedError(
                "invalid_message", f"op {doc['op']!r} is not allowed on an inbound stream", **origin
            )
        return InboundMessage.model_validate(doc)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "payload"
        raise MessageRejectedError(
            "invalid_message", f"{where}: {first['msg']}", **origin
        ) from None


_INVALID = object()


def _try_json(raw: str | bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return _INVALID
