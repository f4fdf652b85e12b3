"""The OpenAI-compatible provider client against a hostile or broken server, as a
reviewer attacked it: a local asyncio server (TCP_NODELAY) answers scripted raw bytes.
Bytes past an answer, chains of codings, JSON nested too deep, fields of the wrong type,
a log line forged by a server's text, answers of too many tool calls or objects."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import tracemalloc
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from worker.agent.providers import OpenAIProvider, ProviderError

Reader = asyncio.StreamReader
Writer = asyncio.StreamWriter


class RawServer:
    """An HTTP/1.1 server that answers each request with what ``answer`` writes: it is
    given the request's last user text and the writer."""

    def __init__(self, answer: Callable[[str, Writer], Awaitable[None]]) -> None:
        self.answer = answer
        self.accepted = 0
        self.requests: list[str] = []
        self.server: asyncio.Server | None = None
        self.writers: list[Writer] = []
        self.handlers: set[asyncio.Task[Any]] = set()

    async def __aenter__(self) -> RawServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for writer in self.writers:
            writer.transport.abort()
        if self.handlers:
            await asyncio.wait(self.handlers, timeout=5)

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/v1"

    async def _serve(self, reader: Reader, writer: Writer) -> None:
        self.accepted += 1
        self.writers.append(writer)
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                request = json.loads(await reader.readexactly(length))
                text = request["messages"][-1]["content"]
                self.requests.append(text)
                await self.answer(text, writer)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            writer.close()


def response(
    body: bytes,
    *,
    status: int = 200,
    content_type: bytes = b"application/json",
    extra: bytes = b"",
) -> bytes:
    return (
        b"HTTP/1.1 %d X\r\nContent-Type: %s\r\nContent-Length: %d\r\n%s\r\n"
        % (status, content_type, len(body), extra)
        + body
    )


def answer_body(text: str) -> bytes:
    doc = {
        "choices": [{"message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]
    }
    return json.dumps(doc).encode()


def sse(*chunks: dict[str, Any] | bytes) -> bytes:
    lines = [
        b"data: " + (c if isinstance(c, bytes) else json.dumps(c).encode()) + b"\n\n"
        for c in chunks
    ]
    return b"".join(lines) + b"data: [DONE]\n\n"


def provider(url: str, **kw: Any) -> OpenAIProvider:
    return OpenAIProvider("m", base_url=url, api_key="k", backoff_s=0.01, **kw)


async def _sink(_piece: str) -> None:
    return None


def ask(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


async def _answered_or_refused(
    answer: Callable[[str, Writer], Awaitable[None]], *, streamed: bool = False
) -> Any:
    """One call against a server answering with ``answer``, not retried: its answer, or
    None when the client refused it with a ProviderError."""
    async with RawServer(answer) as server:
        llm = provider(server.url, max_retries=0)
        try:
            if streamed:
                return await llm.chat_with_retry(messages=ask("x"), on_delta=_sink)
            return await llm.chat_with_retry(messages=ask("x"))
        except ProviderError:
            return None
        finally:
            await llm.aclose()


# --- 1. bytes past a complete response answer the next call --------------------------------


async def test_bytes_after_a_complete_answer_never_become_the_next_calls_answer() -> None:
    """A server that sends more than its ``Content-Length`` (a miscounted length, a
    duplicated answer) leaves bytes on the connection. httpcore keeps what h11 already
    buffered across the keep-alive cycle, so the connection goes back to the pool with
    them and the NEXT call on it - another user's turn - gets them as its answer, and
    every call after that gets the previous call's answer (the connection stays one answer
    behind). A connection with bytes past its response must be dropped, not reused."""

    async def answer(text: str, writer: Writer) -> None:
        if text == "alice":  # her answer, then bytes that look like one more
            writer.write(
                response(answer_body("for alice")) + response(answer_body("alice's secret"))
            )
        else:
            writer.write(response(answer_body(f"for {text}")))

    async with RawServer(answer) as server:
        llm = provider(server.url, max_connections=1, max_retries=0)
        assert (await llm.chat_with_retry(messages=ask("alice"))).content == "for alice"
        got = {}
        for user in ("bob", "carol"):
            try:
                got[user] = (await llm.chat_with_retry(messages=ask(user))).content
            except ProviderError:
                got[user] = None  # an error is acceptable: a wrong answer is not
        await llm.aclose()
    assert got["bob"] in ("for bob", None), f"bob was answered {got['bob']!r}"
    assert got["carol"] in ("for carol", None), f"carol was answered {got['carol']!r}"
    async with RawServer(answer) as server:  # with retries: bob gets his own answer
        llm = provider(server.url, max_connections=1, max_retries=2)
        assert (await llm.chat_with_retry(messages=ask("alice"))).content == "for alice"
        assert (await llm.chat_with_retry(messages=ask("bob"))).content == "for bob"
        await llm.aclose()


# --- 2. an unbounded chain of content codings ----------------------------------------------


async def test_a_long_chain_of_content_codings_is_refused() -> None:
    """``Content-Encoding: gzip, gzip, ...`` makes one zlib decoder per link, with no
    cap: h11 lets a head of 100 KiB through, ~19,000 links, and a 1 MB body nested that
    deep cost 666 MB RSS and 5.5 s of decoding that never yields to the event loop
    (every other turn, stop and lease renewal of the worker waits). This is
    CVE-2025-66418 of urllib3, fixed there by refusing more than 5 links. Here 1,000
    links (a 25 KB body) are decoded and answered."""
    depth = 1000
    body = answer_body("decoded through 1,000 codings")
    for _ in range(depth):
        z = zlib.compressobj(0, zlib.DEFLATED, zlib.MAX_WBITS | 16)
        body = z.compress(body) + z.flush()
    coding = b"Content-Encoding: " + b",".join([b"gzip"] * depth) + b"\r\n"

    async def answer(_text: str, writer: Writer) -> None:
        writer.write(response(body, extra=coding))

    async with RawServer(answer) as server:
        llm = provider(server.url, max_retries=0)
        with pytest.raises(ProviderError):
            await llm.chat_with_retry(messages=ask("hi"))
        await llm.aclose()


# --- 3. hostile JSON escapes the error mapping ---------------------------------------------

_DEEP = b"[" * 100_000


@pytest.mark.parametrize("where", ["answer", "error body", "stream"])
async def test_deeply_nested_json_is_a_provider_error(where: str) -> None:
    """``json.loads`` raises RecursionError (a RuntimeError) on deep nesting; the client
    maps only ValueError, LookupError, TypeError and AttributeError. So 100 KB of ``[``
    escapes as a RecursionError: the turn is not answered ``provider_error`` but counted
    as a failed delivery and run again whole (AGENT_MAX_DELIVERIES times, each with its
    model retries) until it is dead-lettered; a 503 with such a body is not even retried.
    """

    async def answer(_text: str, writer: Writer) -> None:
        if where == "answer":
            writer.write(response(_DEEP))
        elif where == "error body":
            writer.write(response(_DEEP, status=503))
        else:
            body = sse({"choices": [{"delta": {"tool_calls": [{"index": 0}]}}]}, _DEEP)
            writer.write(response(body, content_type=b"text/event-stream"))

    async with RawServer(answer) as server:
        llm = provider(server.url, max_retries=1)
        with pytest.raises(ProviderError):
            await llm.chat_with_retry(
                messages=ask("x"), on_delta=_sink if where == "stream" else None
            )
        await llm.aclose()


async def test_a_streamed_tool_call_whose_arguments_are_an_object_is_a_provider_error() -> None:
    """Streamed fields are joined in ``StreamedAnswer.result()``, which ``_stream`` calls
    outside its ``try``: a server that streams a call's ``arguments`` as a JSON object
    (or a name or content that is not a string) ends the call with a bare TypeError
    ("sequence item 0: expected str instance, dict found") instead of a ProviderError
    (the plain path maps the same answer to APIResponseValidationError)."""

    async def answer(_text: str, writer: Writer) -> None:
        call = {"index": 0, "id": "c1", "function": {"name": "lookup", "arguments": {"a": 1}}}
        body = sse(
            {"choices": [{"delta": {"tool_calls": [call]}}]},
            {"choices": [{"delta": {}, "finish_reason": "tool_calls"}]},
        )
        writer.write(response(body, content_type=b"text/event-stream"))

    resp = await _answered_or_refused(answer, streamed=True)
    if resp is not None:  # refused (ProviderError) is as good
        assert all(isinstance(c.name, str) for c in resp.tool_calls)


@pytest.mark.parametrize("streamed", [False, True], ids=["plain", "streamed"])
async def test_arguments_that_are_not_a_json_object_are_kept_as_malformed(streamed: bool) -> None:
    """A call whose arguments are not a JSON object (cut text, a list) must not become a
    call with no arguments: a tool with optional arguments would run on its defaults."""
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "a", "arguments": '{"x": '}},
        {"id": "c2", "type": "function", "function": {"name": "b", "arguments": "[1]"}},
        {"id": "c3", "type": "function", "function": {"name": "c", "arguments": '{"y": 2}'}},
    ]

    async def answer(_text: str, writer: Writer) -> None:
        if not streamed:
            message = {"role": "assistant", "content": None, "tool_calls": calls}
            doc = {"choices": [{"message": message, "finish_reason": "tool_calls"}]}
            writer.write(response(json.dumps(doc).encode()))
            return
        pieces = [{"index": i, **c} for i, c in enumerate(calls)]
        body = sse(
            {"choices": [{"delta": {"tool_calls": pieces}}]},
            {"choices": [{"delta": {}, "finish_reason": "tool_calls"}]},
        )
        writer.write(response(body, content_type=b"text/event-stream"))

    resp = await _answered_or_refused(answer, streamed=streamed)
    got = [(c.name, c.arguments, c.malformed) for c in resp.tool_calls]
    assert got == [("a", {}, '{"x": '), ("b", {}, "[1]"), ("c", {"y": 2}, None)]


async def test_streamed_calls_without_an_index_stay_apart() -> None:
    """Some servers stream each call whole and leave ``index`` out: two calls must stay
    two (merged, their names and arguments would run as one garbled call), while the
    pieces of one call without an index still join."""

    async def answer(_text: str, writer: Writer) -> None:
        first = {"id": "c1", "function": {"name": "look", "arguments": '{"q": '}}
        rest = {"function": {"arguments": '"a"}'}}
        second = {"id": "c2", "function": {"name": "find", "arguments": '{"q": "b"}'}}
        body = sse(
            *({"choices": [{"delta": {"tool_calls": [piece]}}]} for piece in (first, rest, second)),
            {"choices": [{"delta": {}, "finish_reason": "tool_calls"}]},
        )
        writer.write(response(body, content_type=b"text/event-stream"))

    resp = await _answered_or_refused(answer, streamed=True)
    got = [(c.id, c.name, c.arguments) for c in resp.tool_calls]
    assert got == [("c1", "look", {"q": "a"}), ("c2", "find", {"q": "b"})]


@pytest.mark.parametrize(
    "content",
    [[{"type": "text", "text": "hello"}], 42, {"text": "hello"}],
    ids=["parts", "number", "object"],
)
async def test_an_answer_whose_content_is_not_text_never_reaches_the_turn(content: Any) -> None:
    """``parse_answer`` passes ``message.content`` on whatever its type (some servers
    send a list of content parts). The runner stores it as the answer row and the reply
    (a str field) fails to build: a bare exception in the outcome, so the turn is run
    again until dead-lettered instead of being told ``provider_error`` (or given the
    text of its parts)."""

    async def answer(_text: str, writer: Writer) -> None:
        doc = {"choices": [{"message": {"role": "assistant", "content": content}}]}
        writer.write(response(json.dumps(doc).encode()))

    resp = await _answered_or_refused(answer, streamed=False)
    if resp is not None:  # refused (ProviderError) is as good
        assert resp.content is None or isinstance(resp.content, str), resp.content


# --- 4. the server's text in the worker's log ----------------------------------------------


async def test_a_retried_error_is_logged_on_one_line(caplog: pytest.LogCaptureFixture) -> None:
    """The worker promises one line per record, values from the wire escaped
    (worker/ops/logs.py, ``bus_redis.codec.safe``); the turn's own provider_error line
    is escaped, and left out for a private session. But ``chat_with_retry`` logs each
    retry with the server's error message as it came: a 503 whose message holds a
    newline writes a forged record into the worker's log (and an error body that quotes
    the prompt puts a private session's text there)."""
    forged = "busy\n2030-01-01 00:00:00,000 INFO worker.runtime: forged record"

    async def answer(_text: str, writer: Writer) -> None:
        doc = {"error": {"message": forged}}
        writer.write(response(json.dumps(doc).encode(), status=503))

    caplog.set_level(logging.WARNING, logger="worker.agent.providers.openai_provider")
    async with RawServer(answer) as server:
        llm = provider(server.url, max_retries=1)
        with pytest.raises(ProviderError):
            await llm.chat_with_retry(messages=ask("x"))
        await llm.aclose()
    messages = [r.getMessage() for r in caplog.records if r.name.endswith("openai_provider")]
    assert messages, "the retry was logged"
    for message in messages:
        assert "\n" not in message, f"a record of more than one line: {message!r}"


# --- 5. how much an answer may make --------------------------------------------------------


async def test_an_answer_of_a_hundred_thousand_tool_calls_is_bounded() -> None:
    """Nothing bounds the tool calls of one answer: a 6 MB stream of 100,000 one-line
    calls is returned whole (32 MiB of them made 493,000 calls and 378 MB), and the runner
    then executes every one in that round (each result up to 16,000 characters into the
    history; ARCHITECTURE's table of bounded work has no row for it)."""
    count = 100_000

    async def answer(_text: str, writer: Writer) -> None:
        lines = [
            b'data: {"choices":[{"delta":{"tool_calls":[{"index":%d,"id":"c%d",'
            b'"function":{"name":"message","arguments":"{}"}}]}}]}\n\n' % (i, i)
            for i in range(count)
        ]
        lines.append(b'data: {"choices":[{"delta":{},"finish_reason":"tool_calls"}]}\n\n')
        lines.append(b"data: [DONE]\n\n")
        writer.write(response(b"".join(lines), content_type=b"text/event-stream"))

    resp = await _answered_or_refused(answer, streamed=True)
    if resp is not None:  # refused (ProviderError) is as good
        assert len(resp.tool_calls) <= 1000, f"{len(resp.tool_calls)} tool calls in one answer"


async def test_the_largest_answer_accepted_is_parsed_within_bounded_memory() -> None:
    """The 32 MiB body bound is said to fail a hostile body "not the worker's memory",
    but it bounds bytes, not what ``json.loads`` makes of them: a body of ``{},{},...``
    just under the bound parses into ~11 million dicts, ~750 MB for one call (28x), and
    a worker runs 16 turns at once. Measured with tracemalloc against a 256 MiB budget."""
    from worker.agent.providers import http

    size = http.MAX_BODY_BYTES - 1024
    head = b'{"choices":[{"message":{"content":"ok"}}],"padding":['
    body = head + b"{}," * ((size - len(head)) // 3 - 1) + b"{}]}"

    async def answer(_text: str, writer: Writer) -> None:
        writer.write(response(body))

    async with RawServer(answer) as server:
        llm = provider(server.url, max_retries=0)
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            with contextlib.suppress(ProviderError):
                await llm.chat_with_retry(messages=ask("x"))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
            await llm.aclose()
    assert peak < 256 << 20, f"one call's peak: {peak >> 20} MiB"
