"""Wire schema (v2): validation, limits, reserved metadata, channel of overrides, origin
of rejected payloads."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bus_redis import InboundMessage, MessageRejectedError, OpenTransient, decode_inbound


def _doc(**kw: object) -> str:
    base: dict[str, object] = {
        "v": 2,
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
    assert decode_inbound(_doc(session_key_override="web:thread-9")).session_key == "web:thread-9"


def test_an_override_outside_the_channel_is_invalid() -> None:
    with pytest.raises(MessageRejectedError) as info:
        decode_inbound(_doc(session_key_override="telegram:alice"))
    assert info.value.code == "invalid_message"
    assert "must start with 'web:'" in info.value.detail


def test_reserved_metadata_keys_are_stripped_when_decoded() -> None:
    msg = decode_inbound(_doc(metadata={"_runtime_control": "session_discard", "lang": "en"}))
    assert isinstance(msg, InboundMessage)
    assert msg.metadata == {"lang": "en"}


def test_bytes_that_are_not_utf8_are_invalid() -> None:
    raw = _doc(content="x").encode().replace(b'"x"', b'"' + bytes([0xFF, 0xFE]) + b'"')
    with pytest.raises(MessageRejectedError) as info:
        decode_inbound(raw.decode("utf-8", "surrogateescape"))
    assert (info.value.code, info.value.detail) == ("invalid_message", "payload is not valid UTF-8")


@pytest.mark.parametrize(
    "encode",
    [
        lambda text: text.encode(),
        lambda text: b"\xef\xbb\xbf" + text.encode(),  # a UTF-8 byte order mark
        lambda text: text.encode("utf-16-le"),  # NUL bytes: json reads UTF-16 or -32
        lambda text: text.encode("utf-16-be"),
        lambda text: text.encode("utf-32-le"),
        lambda text: b"\x00" + text.encode(),
        lambda text: text.encode()[:1],
    ],
)
def test_a_payload_is_parsed_as_json_parses_its_bytes(encode: Any) -> None:
    """The text decoded while checking UTF-8 is parsed (a second decode saved) only where
    ``json.loads`` would read the bytes as that text: a byte order mark or leading NULs
    are read as json reads them."""
    raw = encode(_doc(content="é"))
    try:
        expected: object = json.loads(raw)
    except ValueError:
        expected = None
    try:
        got: object = decode_inbound(raw).model_dump(include={"content", "channel"})
    except MessageRejectedError:
        got = None
    if isinstance(expected, dict):
        expected = {"content": expected["content"], "channel": expected["channel"]}
    assert got == expected


@pytest.mark.parametrize(
    ("raw", "code", "channel"),
    [
        ("not json", "invalid_message", None),
        ("[1,2]", "invalid_message", None),
        (_doc(v=1), "invalid_message", "web"),
        (_doc(channel="a:b"), "invalid_message", "a:b"),
        (_doc(chat_id=5), "invalid_message", "web"),
        (_doc(channel=""), "invalid_message", None),
        (
            json.dumps({"v": 2, "op": "discard", "channel": "web", "chat_id": "c"}),
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
                "v": 2,
                "op": "open_transient",
                "channel": "web",
                "chat_id": "c",
                "disabled_tools": ["spawn"],
            }
        )
    )
    assert isinstance(op, OpenTransient)
    assert op.session_key == "web:c"


def test_every_rejection_names_the_message_id_when_it_can_be_read() -> None:
    """Too deep, missing "v", a wrong version: the error still answers the message's own id
    (a frontend waiting on ``reply_to`` hears back); past the parse limit it cannot be read."""
    nested: object = "x"
    for _ in range(33):
        nested = [nested]
    cases = [
        {
            "v": 2,
            "id": "deep-1",
            "channel": "web",
            "sender_id": "u",
            "chat_id": "c",
            "metadata": {"a": nested},
        },
        {"id": "nov-1", "channel": "web", "sender_id": "u", "chat_id": "c"},
        {"v": 1, "id": "old-1", "channel": "web", "sender_id": "u", "chat_id": "c"},
    ]
    for doc in cases:
        with pytest.raises(MessageRejectedError) as info:
            decode_inbound(json.dumps(doc))
        assert info.value.code == "invalid_message"
        assert info.value.message_id == doc["id"]
    abyss = '{"v":2,"id":"lost","metadata":' + "[" * 300 + "]" * 300 + "}"
    with pytest.raises(MessageRejectedError) as info:
        decode_inbound(abyss)
    assert info.value.message_id is None
