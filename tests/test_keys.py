"""Key encoding is injective and keeps every key of a session under one hash tag."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from bus_redis.keys import Keys, decode_session, encode_session

_PIECES = st.sampled_from(
    ["{", "}", "%", ":", "a", "Z", "0", "é", "\x00", "\x1f", "\x7f", "%7B", "%25", " "]
)
HOSTILE = st.lists(_PIECES, max_size=12).map("".join) | st.text(max_size=30)


@given(HOSTILE, HOSTILE)
def test_encoding_is_injective(a: str, b: str) -> None:
    if a != b:
        assert encode_session(a) != encode_session(b)
        assert Keys().inbound(a) != Keys().inbound(b)
        assert Keys().session(a) != Keys().session(b)


@given(HOSTILE)
def test_decode_inverts_encode(key: str) -> None:
    assert decode_session(encode_session(key)) == key


@given(HOSTILE)
def test_encoded_key_has_no_braces_or_controls(key: str) -> None:
    enc = encode_session(key)
    assert not set("{}") & set(enc)
    assert all(0x20 <= ord(ch) != 0x7F for ch in enc)


@given(HOSTILE)
def test_all_session_keys_share_one_hash_tag(key: str) -> None:
    k = Keys("p")
    names = [
        k.inbound(key),
        k.session(key),
        k.lease(key),
        k.epoch(key),
        k.pending(key),
        k.owner(key),
        k.control_flag(key),
        k.attempts(key),
    ]
    tags = {n[n.index("{") + 1 : n.index("}")] for n in names}
    assert tags == {encode_session(key)}


def test_examples() -> None:
    assert encode_session("telegram:42") == "telegram:42"
    assert encode_session("a{b}%c\n") == "a%7Bb%7D%25c%0A"
    assert Keys("agent").inbound("web:{x}") == "agent:{web:%7Bx%7D}:in"
