"""Over the wire: real ``agent-worker run`` processes, a real redis-server, and a local
OpenAI-compatible HTTP server."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from helpers import dump_all
from replies import collect

from bus_redis import FrontendClient, InboundMessage, Keys

pytestmark = [pytest.mark.real_redis, pytest.mark.slow]


def _msg(chat: str, text: str, **kw: object) -> InboundMessage:
    return InboundMessage(
        id=f"{chat}-{text}"[:60], channel="web", sender_id="u", chat_id=chat, content=text, **kw
    )  # type: ignore[arg-type]


async def test_durable_two_turn_history_lands_in_the_session_hash(
    real_redis: aioredis.Redis, spawn_workers, fake_llm
) -> None:  # type: ignore[no-untyped-def]
    spawn_workers(2)
    client = FrontendClient(real_redis)
    first = await client.send(_msg("alice", "my name is Ada"))
    got = await collect(client, "web", {first})
    second = await client.send(_msg("alice", "what is my name"))
    got.update(await collect(client, "web", {second}))

    assert got[first][-1].content == "re: my name is Ada"
    assert got[second][-1].content == "re: what is my name"
    assert "re: my name is Ada" in str(fake_llm.requests[-1]["messages"])  # history replayed
    h = await real_redis.hgetall(Keys().session("web:alice"))
    assert h["count"] == "4"
    assert "what is my name" in h["m:2"]
    assert await real_redis.zscore(Keys().sessions_index("web"), "web:alice") is not None
    assert await real_redis.zscore(Keys().scope_sessions("web/sender:u"), "web:alice") is not None


async def test_transient_content_never_reaches_redis_or_logs(
    real_redis: aioredis.Redis, spawn_workers, fake_llm
) -> None:  # type: ignore[no-untyped-def]
    workers = spawn_workers(2)
    client = FrontendClient(real_redis)
    memory = {"content": "durable memory text", "version": 1}
    await real_redis.hset(Keys().memory("web/sender:u"), mapping=memory)  # type: ignore[arg-type]
    key, opened = await client.open_transient(
        "web", "bob", session_key="web:bob-private", disabled_tools={"create_goal"}
    )
    await collect(client, "web", {opened})
    answers = [  # ask() deletes a private session's events once it has read them
        await client.ask(
            _msg("bob", t, session_key_override=key, require_existing_session=True), timeout_s=20
        )
        for t in ("private alpha", "private beta")
    ]

    assert [a.content for a in answers] == ["re: private alpha", "re: private beta"]
    prompts = [str(r["messages"]) for r in fake_llm.requests]
    assert "re: private alpha" in prompts[-1]  # in-memory history
    assert all("durable memory text" not in p for p in prompts)
    assert all("create_goal" not in str(r.get("tools")) for r in fake_llm.requests)
    everything = await dump_all(real_redis)
    for text in ("private alpha", "private beta"):
        assert text not in everything
        for w in workers:
            assert text not in w.log()


async def test_unified_mode_folds_chats_but_not_transient_sessions(
    real_redis: aioredis.Redis, spawn_workers, fake_llm
) -> None:  # type: ignore[no-untyped-def]
    spawn_workers(2, env={"AGENT_UNIFIED_SESSION": "1"})
    client = FrontendClient(real_redis)
    a = await client.send(_msg("chat-a", "from a"))
    await collect(client, "web", {a})
    b = await client.send(_msg("chat-b", "from b"))
    key, opened = await client.open_transient("web", "chat-c", session_key="web:private-c")
    await collect(client, "web", {b, opened})
    c = await client.send(
        _msg("chat-c", "private c", session_key_override=key, require_existing_session=True)
    )
    await collect(client, "web", {c})

    h = await real_redis.hgetall(Keys().session("unified:default"))
    contents = [h[f"m:{i}"] for i in range(int(h["count"]))]
    assert any("from a" in row for row in contents)
    assert any("from b" in row for row in contents)
    assert not any("private c" in row for row in contents)
    assert '"last_channel":"web:chat-b"' in h["meta"]
    assert "re: from a" in str(fake_llm.requests[1]["messages"])  # chat-b saw chat-a's turn
    assert not await real_redis.exists(
        Keys().session("web:chat-a"), Keys().session("web:private-c")
    )


async def test_a_required_session_that_exists_nowhere_is_not_active(
    real_redis: aioredis.Redis, spawn_workers, fake_llm
) -> None:  # type: ignore[no-untyped-def]
    spawn_workers(2)
    client = FrontendClient(real_redis)
    mid = await client.send(
        _msg("ghost", "hello?", session_key_override="web:ghost", require_existing_session=True)
    )
    got = await collect(client, "web", {mid})
    assert got[mid][-1].type == "error"
    assert got[mid][-1].code == "session_not_active"
    assert fake_llm.requests == []
    assert not await real_redis.exists(Keys().session("web:ghost"))


async def test_a_private_sessions_message_read_by_another_worker_is_forwarded(
    real_redis: aioredis.Redis, spawn_workers, fake_llm
) -> None:  # type: ignore[no-untyped-def]
    """The owner is paused, so the other worker reads the notification: it forwards it to
    the owner's inbox, and the owner answers once it runs again."""
    import signal

    from replies import wait_until_async

    (owner,) = spawn_workers(1)
    client = FrontendClient(real_redis)
    key, opened = await client.open_transient("web", "f", session_key="web:f-private")
    await collect(client, "web", {opened})
    (other,) = spawn_workers(1)
    k = Keys()

    async def other_is_up() -> bool:
        return bool(await real_redis.hget(k.worker_info(other.worker_id), "pid"))

    assert await wait_until_async(other_is_up, timeout_s=20)
    owner.signal(signal.SIGSTOP)
    try:
        mid = await client.send(
            _msg("f", "for the owner", session_key_override=key, require_existing_session=True)
        )

        async def forwarded() -> bool:
            return await real_redis.xlen(k.inbox(owner.worker_id)) > 0

        assert await wait_until_async(forwarded, timeout_s=20)
    finally:
        owner.signal(signal.SIGCONT)
    got = await collect(client, "web", {mid}, timeout_s=20)
    assert got[mid][-1].content == "re: for the owner"
    assert got[mid][-1].metadata["worker"] == owner.worker_id


async def test_chat_cli_talks_durably_and_privately(
    real_redis, spawn_workers, redis_server
) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    spawn_workers(1, env={"AGENT_PROVIDER": "echo"})
    proc = subprocess.Popen(  # noqa: ASYNC220 - started once, then driven from a thread
        [
            sys.executable,
            "-m",
            "worker.cli.main",
            "chat",
            "--redis-url",
            redis_server.url,
            "--chat-id",
            "tty",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdin is not None
    assert proc.stdout is not None

    def say(line: str, expect: str | None = None) -> str:
        proc.stdin.write(line + "\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
        if expect is None:
            return ""
        seen = []
        for out in proc.stdout:  # type: ignore[union-attr]
            seen.append(out)
            if expect in out:
                return out
        raise AssertionError(f"{expect!r} never printed: {seen}")

    try:
        for line, expect in [
            ("hello there", "echo: hello there"),
            ("/temp", "private session"),
            ("secret words", "echo: secret words"),
            ("/discard", None),
            ("/quit", None),
        ]:
            await asyncio.wait_for(asyncio.to_thread(say, line, expect), 20)
        assert await asyncio.to_thread(proc.wait, 20) == 0
    finally:
        proc.kill()
    stored = await real_redis.hgetall(Keys().session("cli:tty"))
    assert "hello there" in str(stored)
    assert "secret words" not in await dump_all(real_redis)


async def test_two_send_commands_in_one_chat_each_get_their_own_reply(
    real_redis, spawn_workers, redis_server
) -> None:  # type: ignore[no-untyped-def]
    """The old shared consumer group let one reader take another's reply; each `send` now
    reads only the events of the message it published."""
    import sys

    spawn_workers(1, env={"AGENT_PROVIDER": "echo", "AGENT_FOLLOWUP_MODE": "queue"})

    async def send(text: str) -> str:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "worker.cli.main", "send", text, "--channel", "web",
            "--chat-id", "shared", "--redis-url", redis_server.url, "--timeout", "20",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await proc.communicate()
        assert proc.returncode == 0, err.decode()
        return out.decode().strip()

    outputs = await asyncio.gather(*(send(f"question {i}") for i in range(4)))
    for i, out in enumerate(outputs):
        assert out.startswith(f"echo: question {i}"), outputs
