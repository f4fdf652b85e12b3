"""Wire protocol v2: the JSON documents frontends and workers exchange (README)."""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)

from bus_redis.errors import MessageRejectedError
from bus_redis.keys import valid_channel

WIRE_VERSION = 2
DEFAULT_MAX_PAYLOAD_BYTES = 256 * 1024

NonEmpty = Annotated[str, StringConstraints(min_length=1, max_length=4096)]


def _channel(value: str) -> str:
    if not valid_channel(value):
        raise ValueError("channel must be 1-64 letters, digits, '_' or '-' (not 'unified')")
    return value


Channel = Annotated[str, AfterValidator(_channel)]
ErrorCode = Literal[
    "session_not_active",
    "invalid_message",
    "too_large",
    "dead_lettered",
    "cancelled",
    "duplicate",
    "limit_exceeded",
    "session_lost",
    "provider_error",
    "busy",
]
SESSION_NOT_ACTIVE = "required session is not active"
ControlOp = Literal["discard", "stop", "delete", "new", "interrupt"]
CONTROL_OPS: tuple[str, ...] = ("stop", "discard", "delete", "new", "interrupt")
# senders of the system messages workers publish themselves (a schedule's firing, a
# subagent's result): such a message never starts a session of its own
WORKER_SENDERS = frozenset({"cron", "subagent"})
# What a message does when its session's turn is running (double texting): join it
# (inject), wait for it (queue), cancel it and start again with everything pending
# (interrupt), or be refused at once with `busy` (reject)
FollowUp = Literal["inject", "queue", "interrupt", "reject"]


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=False, strict=True)

    v: Literal[2] = 2


class _Routed(_Wire):
    """Documents addressed to a session of the frontend's own channel."""

    channel: Channel
    chat_id: NonEmpty
    session_key_override: NonEmpty | None = None

    @property
    def session_key(self) -> str:
        return self.session_key_override or f"{self.channel}:{self.chat_id}"

    @model_validator(mode="after")
    def _own_channel(self) -> _Routed:
        if self.session_key_override is not None and not self.session_key_override.startswith(
            f"{self.channel}:"
        ):
            raise ValueError(f"session_key_override must start with '{self.channel}:'")
        return self


class InboundMessage(_Routed):
    """A user (or system) message for one session."""

    id: str | None = None
    sender_id: NonEmpty
    content: str = ""
    media: list[str] = Field(default_factory=list)
    metadata: dict[str, Any] = Field(default_factory=dict)
    scope: NonEmpty | None = None  # the user or workspace the frontend vouches for
    # whose share of the per-scope limits a session it starts counts against (a user
    # holding several scopes); absent: the scope
    quota: NonEmpty | None = None
    require_existing_session: bool = False
    input_role: Literal["user", "system"] | None = None
    timestamp: datetime | None = Field(default=None, strict=False)
    followup: FollowUp | None = None  # this message's double-texting mode (else the default)

    @field_validator("metadata")
    @classmethod
    def _strip_reserved(cls, value: dict[str, Any]) -> dict[str, Any]:
        """Keys starting with ``_`` are reserved for the worker: never taken from the wire."""
        return {k: v for k, v in value.items() if not k.startswith("_")}

    @property
    def worker_made(self) -> bool:
        """A system message of the kind workers publish (``WORKER_SENDERS``)."""
        return self.input_role == "system" and self.sender_id in WORKER_SENDERS

    @property
    def is_user_input(self) -> bool:
        """Whether a user wrote it: any message but a system one (``input_role`` decides,
        never the channel's name: ``system`` is a channel like any other here)."""
        return self.input_role != "system"


class OpenTransient(_Routed):
    """Opens a private session owned by the worker that processes it."""

    op: Literal["open_transient"]
    id: str | None = None
    sender_id: str = "frontend"
    scope: NonEmpty | None = None
    disabled_tools: list[str] = Field(default_factory=list)


class ControlMessage(_Wire):
    """A control published on ``P:{C}:control``."""

    op: ControlOp
    session_key: NonEmpty
    # the id of the marker in the session's stream: a worker running an entry before it
    # cancels at once, without reading the stream (optional: without it, it reads)
    marker: Annotated[str, Field(pattern=r"^[0-9]{1,20}-[0-9]{1,20}$")] | None = None


class OutboundMessage(_Wire):
    """A reply or event on the session's stream ``P:{C}:out:S``."""

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
    entry_id: str | None = Field(default=None, exclude=True)  # set by readers: resume point

    @property
    def is_terminal(self) -> bool:
        return self.type in ("message", "error")

    @property
    def is_loss_notice(self) -> bool:
        """The unsolicited ``session_lost`` of a private session whose worker died or that
        closed idle: its events went with it (all but error answers), so an answer a
        reader had not read yet is gone, and this notice ends its wait."""
        return self.code == "session_lost" and not self.reply_to


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
    """Parse and validate one inbound payload; raise :class:`MessageRejectedError`.

    A ``str`` payload may carry undecodable bytes as surrogates (``codec.payload_text``):
    it is rejected as not UTF-8."""
    data = raw.encode("utf-8", "surrogateescape") if isinstance(raw, str) else raw
    size = len(data)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise MessageRejectedError("invalid_message", "payload is not valid UTF-8") from None
    if size > max_bytes:
        origin = _origin(_try_json(data)) if size <= 16 * max_bytes else {}
        raise MessageRejectedError(
            "too_large", f"payload is {size} bytes, limit {max_bytes}", **origin
        )
    depth = _depth(data, PARSE_DEPTH)
    if depth > MAX_DEPTH:  # parsed only while the parser is safe, to answer the right id
        origin = _origin(_try_json(data)) if depth <= PARSE_DEPTH else {}
        raise MessageRejectedError(
            "invalid_message", f"payload nests deeper than {MAX_DEPTH}", **origin
        )
    # the text already decoded is what json.loads would decode the bytes as, unless they
    # start with a UTF-8 BOM or a NUL (read as UTF-16 or -32 there): then as it would
    utf8 = data[:1] != b"\xef" and b"\x00" not in data[:2]
    doc = _try_json(text if utf8 else data)
    if doc is _INVALID:
        raise MessageRejectedError("invalid_message", "payload is not valid JSON")
    if _LONE_SURROGATE.search(data):
        doc = _without_lone_surrogates(doc)
    if not isinstance(doc, dict):
        raise MessageRejectedError("invalid_message", "payload is not a JSON object")
    if "v" not in doc:
        raise MessageRejectedError(
            "invalid_message", 'missing wire version "v" (2)', **_origin(doc)
        )
    if doc["v"] != WIRE_VERSION or isinstance(doc["v"], bool):
        raise MessageRejectedError(
            # (never the value: a rejection's detail is kept in dead letters, also private ones)
            "invalid_message",
            f"unsupported wire version (only {WIRE_VERSION})",
            **_origin(doc),
        )
    try:
        if doc.get("op") == "open_transient":
            return OpenTransient.model_validate(doc)
        if "op" in doc:
            raise MessageRejectedError(
                "invalid_message",
                "op is not allowed on an inbound stream (only open_transient)",
                **_origin(doc),
            )
        return InboundMessage.model_validate(doc)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])[:200] or "payload"
        raise MessageRejectedError(
            "invalid_message", f"{where}: {first['msg']}", **_origin(doc)
        ) from None


_INVALID = object()
MAX_DEPTH = 32  # of arrays and objects in a payload (metadata included)
PARSE_DEPTH = 256  # deeper than this is rejected without parsing (its id stays unknown)
_LONE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")  # a \uD800-\uDFFF escape (maybe unpaired)


def _depth(data: bytes, cap: int) -> int:
    """How deep JSON text nests (arrays and objects), counted up to ``cap + 1``: checked
    before parsing, so a hostile payload never drives the parser into a RecursionError."""
    if data.count(b"[") + data.count(b"{") <= MAX_DEPTH:
        return 0  # the usual case, decided at C speed
    depth = deepest = 0
    in_string = escaped = False
    for byte in data:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            deepest = max(deepest, depth)
            if deepest > cap:
                return deepest
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return deepest


def _without_lone_surrogates(doc: Any) -> Any:
    """JSON may escape half of a surrogate pair (a browser's JSON.stringify of a broken
    emoji): such a string cannot be encoded as UTF-8 anywhere later, so the half becomes
    U+FFFD here; proper pairs stay as they are."""
    text = json.dumps(doc, ensure_ascii=False)
    try:
        text.encode("utf-8")
        return doc
    except UnicodeEncodeError:
        fixed = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        return json.loads(fixed)


def _try_json(raw: str | bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return _INVALID
