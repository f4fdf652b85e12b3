"""The chat CLI as a person uses it, through a pipe and through a terminal (a pty), with a
real worker process and the local fake LLM; and the other commands' rough edges (one
line instead of a traceback, a closed pipe, saying when there is nothing to show)."""

from __future__ import annotations

import os
import pty
import queue
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest
import redis
from helpers import run_cli

from bus_redis import FrontendClient, Keys
from worker.cli.frontend import _Chat

pytestmark = pytest.mark.real_redis


def _chat(url: str, text: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "worker.cli.main", "chat", "--redis-url", url, "--wait", "30",
         *args],
        input=text, capture_output=True, text=True, timeout=90,
    )  # fmt: skip


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(*args)  # type: ignore[no-any-return]


def test_chat_through_a_pipe_waits_for_its_answers(redis_server, spawn_workers, fake_llm) -> None:  # type: ignore[no-untyped-def]
    spawn_workers(1, env={"AGENT_FOLLOWUP_MODE": "queue"})  # an answer per line
    res = _chat(redis_server.url, "Hi\nWhat is my name?\n/bogus\n/help\n")  # then EOF
    out = res.stdout
    assert res.returncode == 0, res.stderr
    assert "re: Hi" in out
    assert "re: What is my name?" in out  # answered before the CLI ended at end of input
    assert "[unknown command /bogus; /help lists them]" in out
    assert "/temp      open a private session" in out
    assert all("/bogus" not in str(r) for r in fake_llm.requests)  # never sent to the model


def test_chat_says_where_each_line_goes(redis_server, spawn_workers) -> None:  # type: ignore[no-untyped-def]
    spawn_workers(1)
    script = "/stop\n/temp\nsecret one\n/discard\nin the stored chat\n/new\nfresh\n/quit\n"
    out = _chat(redis_server.url, script, "--chat-id", "walk").stdout
    lines = out.splitlines()
    assert "[stop sent for cli:walk]" in lines  # nothing queued: it cancels nothing
    opened = next(i for i, line in enumerate(lines) if line.startswith("[now in private session"))
    back = next(i for i, line in enumerate(lines) if "discarded; back to cli:walk]" in line)
    assert opened < back
    # each message gets exactly one answer, shown although the CLI switched sessions
    # since: its reply, or - if the marker after it came first - "cancelled"
    answers = {
        "secret one": ("re: secret one", "cancelled by discard"),
        "in the stored chat": ("re: in the stored chat", "cancelled by new"),
    }
    for text, (reply, cancelled) in answers.items():
        assert (reply in out) != (cancelled in out), (text, out)
    assert "[new conversation in cli:walk: the previous one goes into long-term memory]" in lines
    assert "re: fresh" in out


def _until(read: Callable[[], str], want: str, timeout_s: float = 30) -> str:
    deadline = time.monotonic() + timeout_s
    seen = ""
    while time.monotonic() < deadline:
        seen += read()
        if want in seen:
            return seen
    raise AssertionError(f"{want!r} not seen in {seen[-2000:]!r}")


def test_chat_in_a_terminal_prompts_and_streams(redis_server, spawn_workers) -> None:  # type: ignore[no-untyped-def]
    spawn_workers(1, env={"AGENT_STREAM_DELTAS": "1"})
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker.cli.main", "chat", "--redis-url", redis_server.url,
         "--chat-id", "tty"],
        stdin=slave, stdout=slave, stderr=slave, close_fds=True,
    )  # fmt: skip
    os.close(slave)

    def read() -> str:
        ready, _, _ = select.select([master], [], [], 0.2)
        return os.read(master, 4096).decode(errors="replace") if ready else ""

    try:
        _until(read, "> ")  # the prompt marker
        os.write(master, b"hello there\n")
        seen = _until(read, "re: hello there")
        assert seen.count("re: hello there") == 1  # streamed, not printed twice
        os.write(master, b"/quit\n")
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)


def test_other_commands_end_with_one_line(redis_server) -> None:  # type: ignore[no-untyped-def]
    bad = _cli("send", "hi", "--session", "web:1-x", "--require-existing", "--redis-url",
               redis_server.url)  # fmt: skip
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0
    assert "session_key_override must start with 'cli:'" in bad.stderr
    empty = _cli("dlq", "list", "--redis-url", redis_server.url)
    assert empty.stdout.strip() == "(no dead letters in any channel)"
    sync = redis.Redis.from_url(redis_server.url, decode_responses=True)
    before = sync.set("agent:mode", "per-session", get=True)  # (shared: other tests' workers)
    try:
        memory = _cli("memory", "show", "--redis-url", redis_server.url)
    finally:
        if before is None:
            sync.delete("agent:mode")
        else:
            sync.set("agent:mode", before)
        sync.close()
    assert memory.returncode == 2
    assert memory.stderr.strip().count("\n") == 0
    assert "memory show needs --scope CHANNEL/NAME" in memory.stderr
    memory = _cli("memory", "show", "--scope", "web/sender:nobody", "--redis-url",
                  redis_server.url)  # fmt: skip
    assert memory.stdout.startswith("(no long-term memory in scope web/sender:nobody;")


def test_a_reader_that_goes_away_is_no_error(redis_server) -> None:  # type: ignore[no-untyped-def]
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker.cli.main", "acl", "worker", "--password", "x" * 70_000],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    proc.stdout.read(10)  # like `| head -c 10`
    proc.stdout.close()
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert b"Broken pipe" not in err
    assert b"Redis" not in err


_readers: dict[int, queue.Queue[str]] = {}


def _lines_until(proc: subprocess.Popen[str], want: str, timeout_s: float = 30) -> str:
    """Read the process's output line by line (a reader thread per process: a line
    already buffered is never missed) until a line contains ``want``."""
    assert proc.stdout is not None
    stdout = proc.stdout
    lines = _readers.get(proc.pid)
    if lines is None:
        lines = _readers[proc.pid] = queue.Queue()
        threading.Thread(
            target=lambda: [lines.put(line) for line in iter(stdout.readline, "")],  # type: ignore[union-attr]
            daemon=True,
        ).start()
    seen = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            break
        seen.append(line)
        if want in line:
            return "".join(seen)
    raise AssertionError(f"{want!r} not seen in {''.join(seen)[-2000:]!r}")


def test_ctrl_c_waits_for_the_answer_on_its_way(redis_server, spawn_workers, fake_llm) -> None:  # type: ignore[no-untyped-def]
    import signal

    spawn_workers(1)
    fake_llm.rearm()  # "block" is held until released
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker.cli.main", "chat", "--redis-url", redis_server.url,
         "--chat-id", "ctrlc", "--wait", "30"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        bufsize=1,
    )  # fmt: skip
    try:
        assert proc.stdin is not None
        _lines_until(proc, "chatting as cli:ctrlc")
        proc.stdin.write("please block\n")
        proc.stdin.flush()
        assert fake_llm.started.wait(20)
        proc.send_signal(signal.SIGINT)  # Ctrl-C while the answer is on its way
        fake_llm.release()
        assert "re: please block" in _lines_until(proc, "re: please block")
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_session_lost_says_what_to_do(redis_server, spawn_workers) -> None:  # type: ignore[no-untyped-def]
    (worker,) = spawn_workers(1)
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker.cli.main", "chat", "--redis-url", redis_server.url,
         "--chat-id", "lost"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        bufsize=1,
    )  # fmt: skip
    try:
        assert proc.stdin is not None
        proc.stdin.write("/temp\nhello\n")
        proc.stdin.flush()
        _lines_until(proc, "re: hello")
        assert worker.terminate() == 0  # its private sessions are reported lost
        out = _lines_until(proc, "[the private session is gone")
        assert "/durable goes back to the stored chat, /temp opens a new one" in out
        proc.stdin.write("/quit\n")
        proc.stdin.flush()
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_demo_keep_cleans_up_on_sigterm() -> None:
    import re
    import signal
    import socket

    proc = subprocess.Popen(
        [sys.executable, "-m", "worker.cli.main", "demo", "--keep"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
    )  # fmt: skip
    try:
        head = _lines_until(proc, "Redis: ")
        port = int(re.search(r"127\.0\.0\.1:(\d+)", head).group(1))  # type: ignore[union-attr]
        _lines_until(proc, "Ctrl-C to stop", timeout_s=60)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        with (
            pytest.raises(ConnectionRefusedError),
            socket.create_connection(("127.0.0.1", port), timeout=1),
        ):
            pass  # its Redis is gone with it
    finally:
        if proc.poll() is None:
            proc.kill()


def test_bad_keys_and_scopes_are_refused_in_one_line() -> None:
    for args in (["stop", "{x"], ["discard", "nokey"], ["memory", "set", "hi", "--scope", "bad"]):
        res = _cli(*args, "--redis-url", "redis://127.0.0.1:1/0")  # refused before any Redis
        assert res.returncode == 2, args
        assert res.stderr.count("\n") == 1, args
        assert res.stderr.startswith("agent-worker: "), args


async def test_new_in_a_private_session_publishes_a_discard(redis) -> None:  # type: ignore[no-untyped-def]
    """/new in a private session is its discard, and says so on the wire: a `new` on the
    private key could be applied to a shared session once the private one has ended
    (unified mode); in the stored chat it stays a `new`."""
    chat, keys = _Chat(FrontendClient(redis), "cli", "walk"), Keys()
    chat.transient = "cli:walk-private-abc123"
    assert await chat.handle("/new")
    assert chat.transient is None
    marker = await redis.xrange(keys.inbound("cli:walk-private-abc123"))
    assert [fields for _id, fields in marker] == [{"control": "discard"}]
    assert await chat.handle("/discard")  # in the stored chat: a discard, nothing else
    assert await chat.handle("/new")
    marker = await redis.xrange(keys.inbound("cli:walk"))
    assert [fields for _id, fields in marker] == [{"control": "discard"}, {"control": "new"}]
