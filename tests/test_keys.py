"""Key encoding is injective; every key of a session carries its channel's hash tag."""

from __future__ import annotations

from typing import Any

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


@given(st.lists(HOSTILE, min_size=1, max_size=6))
def test_a_bus_names_a_session_s_keys_as_keys_does(members: list[str]) -> None:
    """The bus's cached names (built once per session) are the names ``Keys`` gives, for
    any key, whether it is cached or built again after the cache started over."""
    from bus_redis import streams

    bus = streams.RedisBus.__new__(streams.RedisBus)
    bus.keys, bus._names, bus._channels = Keys("p"), {}, {}
    k = bus.keys
    for m in [*members, *members]:  # the second pass reads the cache
        n = bus.names(f"ch:{m}")
        s, c = f"ch:{m}", "ch"
        assert (n.lease, n.pending, n.session, n.inbound) == (
            k.lease(s), k.pending(s), k.session(s), k.inbound(s)
        )  # fmt: skip
        assert (n.attempts, n.out, n.owner, n.journal) == (
            k.attempts(s), k.out(s), k.owner(s), k.journal(s)
        )  # fmt: skip
        assert n.stream == (
            k.inbound(s), k.attempts(s), k.control_hint(s), k.owner(s), k.ready(c), k.lease(s),
            k.queued(c),
        )  # fmt: skip
        ch = n.channel
        assert (ch.leases, ch.sessions_index, ch.owners, ch.dead, ch.pulse) == (
            k.leases(c), k.sessions_index(c), k.owners(c), k.dead(c), k.pulse(c)
        )  # fmt: skip


def test_the_bus_s_name_cache_is_bounded(monkeypatch: Any) -> None:
    from bus_redis import streams, turn_keys

    monkeypatch.setattr(turn_keys, "NAMES_CACHED", 8)
    bus = streams.RedisBus.__new__(streams.RedisBus)
    bus.keys, bus._names, bus._channels = Keys(), {}, {}
    for i in range(100):
        bus.names(f"web:{i}")
        assert len(bus._names) <= 8
    bus.names("web:" + "x" * 200)  # too long to be kept
    assert all(len(key) <= turn_keys.NAMED_KEY_CHARS for key in bus._names)


def test_nonces_are_unique_and_a_forked_child_draws_its_own() -> None:
    import os

    from bus_redis.codec import fresh_nonce

    seen = {fresh_nonce() for _ in range(10_000)}
    assert len(seen) == 10_000
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its nonces share no prefix with the parent's
        os.write(write, fresh_nonce().encode())
        os._exit(0)
    os.waitpid(pid, 0)
    child = os.read(read, 100).decode()
    os.close(read)
    os.close(write)
    mine = fresh_nonce()
    assert child not in seen
    assert child[:16] != mine[:16]
