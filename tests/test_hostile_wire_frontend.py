"""A hostile frontend that speaks the wire directly (README, "Wire protocol v2"), as a
program in another language would: raw MULTI / XADD / ZADD / PUBLISH, never
``FrontendClient``. Hostile review of 5546f64: each test shows a promise of README /
ARCHITECTURE / SECURITY that a frontend of one channel could break, and failed on
5546f64. A fifth finding (an old id re-sent while a later message's turn runs was
covered by that turn) is tested in ``test_double_texting.py``."""

from __future__ import annotations

import json
from typing import Any

import redis.asyncio as aioredis
from replies import collect

from bus_redis import FrontendClient, Keys
from worker.agent.providers import EchoProvider

K = Keys()


async def publish(redis: aioredis.Redis, session: str, payload: str | bytes) -> str:
    """README's "Send a message" transaction, command for command; the entry id."""
    channel = session.partition(":")[0]
    async with redis.pipeline(transaction=True) as pipe:
        pipe.execute_command("XADD", K.inbound(session), "*", "payload", payload)
        pipe.execute_command("ZADD", K.queued(channel), "NX", 0, session)
        pipe.execute_command(
            "XADD", K.ready(channel), "MAXLEN", "~", 1000000, "*", "session", session
        )
        entry_id, _, _ = await pipe.execute()
    return entry_id if isinstance(entry_id, str) else entry_id.decode()


def doc(chat: str, content: str, **extra: Any) -> str:
    base = {"v": 2, "channel": "web", "sender_id": "u1", "chat_id": chat, "content": content}
    return json.dumps({**base, **extra}, ensure_ascii=False)


# --- 1. forged metadata.from ------------------------------------------------------------
async def test_a_forged_from_of_unicode_digits_is_not_a_crash_retried_into_a_dead_letter(  # type: ignore[no-untyped-def]
    redis_factory, make_loop
) -> None:
    """Promise: a poison payload (forged metadata such as ``metadata.from``) is answered
    once for what it is; a turn is retried and dead-lettered only when it *fails*.

    Defect: for a system message from ``cron`` / ``subagent`` (README: whether a message
    is one is decided by ``input_role`` alone, so any frontend may send one), the worker
    compares ``metadata.from`` with the session's first entry via
    ``codec.parse_stream_id``, which accepts any ``str.isdigit()`` text ("²", "①") and
    then calls ``int()`` on it: ``ValueError`` inside the turn. The entry is taken for a
    failing turn, re-run ``AGENT_MAX_DELIVERIES`` times (each logged with a traceback)
    and ends ``dead_lettered``, its payload copied into the dead letters. A ``from`` that
    is no stream id must read as unknown (or as older): one answer, no retries."""
    redis = redis_factory()
    make_loop(EchoProvider())
    client = FrontendClient(redis)
    await publish(redis, "web:r1", doc("r1", "hello", id="m1"))
    await collect(client, "web", {"m1"}, timeout_s=15)
    forged = doc(
        "r1", "tick", id="f1", input_role="system", sender_id="cron", metadata={"from": "²-1"}
    )
    await publish(redis, "web:r1", forged)
    got = await collect(client, "web", {"f1"}, timeout_s=20)
    [answer] = [e for e in got["f1"] if e.is_terminal]
    assert answer.code != "dead_lettered", (answer.code, answer.content)
    assert await redis.xlen(K.dead("web")) == 0, "a readable message was dead-lettered"


# --- 2. worker memory in proportion to what a channel wrote --------------------------------
async def test_disabled_tool_sets_a_frontend_names_do_not_pile_up_in_worker_memory(  # type: ignore[no-untyped-def]
    redis_factory, make_loop
) -> None:
    """Promise (ARCHITECTURE "Bounded work", SECURITY "Memory it can make workers hold is
    bounded"): nothing a channel writes makes a worker hold memory in proportion to it.

    Defect: ``ContextBuilder._static`` (worker/agent/prompt.py) caches the system prompt
    per *set of disabled tool names*, keyed by the raw ``frozenset`` an
    ``open_transient`` payload names (unknown names included, any length), and is never
    bounded or evicted. Re-opening one private session again and again, each time with
    another ``disabled_tools`` list, leaves one prompt (and the key's strings) per
    opening in every worker that served it, for the life of the process: the private
    session cap (1000 per channel) does not bound it, since the sessions end. (The
    sibling cache, ``ToolRegistry.definitions``, stays within 64.)"""
    redis = redis_factory()
    loop = make_loop(EchoProvider())
    client = FrontendClient(redis)
    rounds = 150  # more than the 2**7 subsets of the 7 real tool names
    ids: set[str] = set()
    for i in range(rounds):
        junk = [f"not-a-tool-{i}-" + "x" * 1000]
        opening = {
            "v": 2, "op": "open_transient", "id": f"o{i}", "channel": "web", "chat_id": "p",
            "session_key_override": "web:p", "disabled_tools": junk,
        }  # fmt: skip
        await publish(redis, "web:p", json.dumps(opening))
        message = doc("p", f"hi {i}", id=f"m{i}", session_key_override="web:p")
        await publish(redis, "web:p", message)
        ids |= {f"o{i}", f"m{i}"}
    got = await collect(client, "web", ids, timeout_s=60)
    assert all(any(e.type == "message" for e in got[f"m{i}"]) for i in range(rounds))
    cached = loop.rt.runner.context._static
    held = sum(len(name) for key in cached for name in key)
    assert len(cached) <= 2**7, f"{len(cached)} prompts cached, {held} characters of keys"


# --- 4/5. what a rejection's reason quotes ----------------------------------------------
async def _dead_letters(redis: aioredis.Redis) -> list[str]:
    return [fields["entry"] for _, fields in await redis.xrange(K.dead("web"))]


async def test_a_private_payloads_dead_letter_keeps_none_of_its_text_even_in_v_or_op(  # type: ignore[no-untyped-def]
    redis_factory, make_loop
) -> None:
    """Promise (README, payload rules): "the dead letter of a payload that is (or says it
    is) for a private session ... keeps sizes, a SHA-256 and the reason, never the text,
    whichever worker writes it" (dead letters never expire).

    Defect: ``decode_inbound`` (bus_redis/schema.py) puts the *value* of ``v`` and of
    ``op`` into the rejection's detail (``unsupported wire version {v!r}``, ``op {op!r} is
    not allowed``), and ``dead_letter`` (worker/runtime/outcomes.py) stores that detail as
    the ``reason`` of a private dead letter: the text is kept for good, in the one record
    that promises to hold none of it."""
    redis = redis_factory()
    make_loop(EchoProvider())
    client = FrontendClient(redis)
    secret = "PRIVATE-TEXT my card is 4111 1111 1111 1111"
    for i, field in enumerate(("v", "op")):
        payload = {
            "v": 2, "id": f"bad{i}", "channel": "web", "chat_id": "p", "sender_id": "u",
            "session_key_override": "web:p", "require_existing_session": True, "content": "x",
            field: secret,
        }  # fmt: skip
        await publish(redis, "web:p", json.dumps(payload))
    got = await collect(client, "web", {"bad0", "bad1"}, timeout_s=15)
    assert {e.code for rid in ("bad0", "bad1") for e in got[rid] if e.is_terminal} == {
        "invalid_message"
    }
    letters = await _dead_letters(redis)
    assert len(letters) == 2
    assert all(json.loads(d).get("private") for d in letters)
    assert not [d for d in letters if "PRIVATE-TEXT" in d], letters


async def test_a_dead_letter_keeps_at_most_64_kib_of_a_payload_whatever_field_it_is_in(  # type: ignore[no-untyped-def]
    redis_factory, make_loop
) -> None:
    """Promise (README / SECURITY): dead letters keep at most 64 KiB of a payload ("dead
    letters do not expire: a frontend must not be able to park megabytes there").

    Defect: the 64 KiB cut applies to the ``payload`` field of the record only; the
    ``reason`` quotes an ``op`` (or ``v``) value whole, so a 250 KB ``op`` parks ~250 KB
    more per dead letter (x ``AGENT_REPLY_MAXLEN`` = 1000 kept per channel), and the same
    text again in the error event."""
    redis = redis_factory()
    make_loop(EchoProvider())
    client = FrontendClient(redis)
    payload = {
        "v": 2, "id": "big", "channel": "web", "chat_id": "b", "sender_id": "u",
        "content": "x", "op": "y" * 250_000,
    }  # fmt: skip
    await publish(redis, "web:b", json.dumps(payload))
    got = await collect(client, "web", {"big"}, timeout_s=15)
    assert [e.code for e in got["big"] if e.is_terminal] == ["invalid_message"]
    [letter] = await _dead_letters(redis)
    assert len(letter.encode()) <= 64 * 1024 + 4096, f"dead letter of {len(letter)} bytes"
