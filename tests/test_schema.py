"""Wire schema: validation, limits, reserved metadata, origin of rejected payloads."""

from __future__ import annotations

import json

import pytest

from bus_redis import InboundMessage, MessageRejectedError, OpenTransient, decode_inbound


def _doc(**kw: object) -> str:
    base: dict[str, object] = {
        "v": 1,
        "channel": "web",
        "sender_id": "u",
        "chat_id": "c1",
        "content": "hi",
    }
    base.update(kw)
    return json.dumps(base)


def test_valid_message_and_session_key() -> None:
    msg = decode_inbound(_doc())
    assert isinstance(msg, InboundMessage)
    assert msg.session_key == "web:c1"
    assert decode_inbound(_doc(session_key_override="thread:9")).session_key == "thread:9"


def test_reserved_metadata_keys_are_stripped_before_the_turn() -> None:
    msg = decode_inbound(_doc(metadata={"_runtime_control": "session_discard", "lang": "en"}))
    assert isinstance(msg, InboundMessage)
    assert msg.public_metadata() == {"lang": "en"}


@pytest.mark.parametrize(
    ("raw", "code", "channel"),
    [
        ("not json", "invalid_message", None),
        ("[1,2]", "invalid_message", None),
        (_doc(v=2), "invalid_message", "web"),
        (_doc(chat_id=5), "invalid_message", "web"),
        (_doc(channel=""), "invalid_message", None),
        (
            json.dumps({"v": 1, "op": "discard", "channel": "web", "chat_id": "c"}),
            "invalid_message",
            "web",
        ),
        (_doc(content="x" * 300_000), "too_large", "web"),
    ],
)
def test_rejections_carry_code_and_origin(raw: str, code: str, channel: str | None) -> None:
    with pytest.raises(MessageRejectedError) as info:
        decode_inbound(raw)
    assert info.value.code == code
    assert info.value.channel == channel


def test_open_transient() -> None:
    op = decode_inbound(
        json.dumps(
            {
                "v": 1,
                "op": "open_transient",
                "channel": "web",
                "chat_id": "c",
                "disabled_tools": ["spawn"],
            }
        )
    )
    assert isinstance(op, OpenTransient)
    assert op.session_key == "web:c"
