"""Key encoding is injective; every key of a session carries its channel's hash tag."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from bus_redis.keys import Keys, decode_session, encode_session, in_channel, valid_channel

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
def test_all_keys_of_a_session_share_its_channel_tag(rest: str) -> None:
    k = Keys("p")
    key = f"web:{rest}"
    names = [
        k.inbound(key),
        k.session(key),
        k.lease(key),
        k.pending(key),
        k.owner(key),
        k.control_hint(key),
        k.attempts(key),
        k.out(key),
        k.ready("web"),
        k.owners("web"),
        k.dead("web"),
        k.sessions_index("web"),
        k.memory("web/alice"),
    ]
    tags = {n[n.index("{") + 1 : n.index("}")] for n in names}
    assert tags == {"web"}
    assert k.session_of_inbound(k.inbound(key)) == (key if rest else None)


@given(HOSTILE)
def test_a_session_key_belongs_to_exactly_its_channel(rest: str) -> None:
    assert in_channel(f"web:{rest}", "web") == bool(rest)
    assert not in_channel(f"web:{rest}", "we")
    assert not in_channel(f"webx:{rest}", "web")


def test_channel_names_are_safe_in_acl_patterns() -> None:
    for bad in ["", "a:b", "a*", "a?", "a[b]", "a{b}", "unified", "x" * 65, "a b", "é"]:
        assert not valid_channel(bad)
    assert valid_channel("web")
    assert valid_channel("tele-gram_2")


def test_examples() -> None:
    assert encode_session("telegram:42") == "telegram:42"
    assert encode_session("a{b}%c\n") == "a%7Bb%7D%25c%0A"
    assert Keys("agent").inbound("web:{x}") == "agent:{web}:in:web:%7Bx%7D"
    assert Keys("agent").out("web:42") == "agent:{web}:out:web:42"
