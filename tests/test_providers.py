"""The OpenAI-compatible provider against a local HTTP server; the echo provider."""

from __future__ import annotations

import asyncio
import base64
import time

import pytest
from fake_llm import FakeLLM

from worker.agent.providers import EchoProvider, OpenAIProvider, ProviderError


def _provider(llm: FakeLLM, **kw: object) -> OpenAIProvider:
    return OpenAIProvider("fake", base_url=llm.base_url, api_key="k", backoff_s=0.01, **kw)  # type: ignore[arg-type]


async def test_answer_and_usage(fake_llm: FakeLLM) -> None:
    resp = await _provider(fake_llm).chat_with_retry(messages=[{"role": "user", "content": "hi"}])
    assert resp.content == "re: hi"
    assert resp.usage["total_tokens"] == 2
    assert fake_llm.requests[0]["model"] == "fake"


async def test_5xx_is_retried_then_reported(fake_llm: FakeLLM) -> None:
    provider = _provider(fake_llm, max_retries=2)
    with pytest.raises(ProviderError, match="InternalServerError"):
        await provider.chat_with_retry(messages=[{"role": "user", "content": "fail please"}])
    assert len(fake_llm.requests) == 3


async def test_unreachable_server_is_a_provider_error() -> None:
    from servers import free_port

    provider = OpenAIProvider(
        "m", base_url=f"http://127.0.0.1:{free_port()}/v1", backoff_s=0.01, max_retries=1
    )
    with pytest.raises(ProviderError, match="APIConnectionError"):
        await provider.chat_with_retry(messages=[{"role": "user", "content": "x"}])


async def test_a_cancelled_call_ends_before_its_request_is_cleaned_up(fake_llm: FakeLLM) -> None:
    """A stop's `cancelled` answer waits for the turn to end: the call ends in the event
    loop's next step, and the connection pool's clean-up (steps of its own, each long on a
    busy worker) runs in the background. Counted in loop steps, not time."""
    provider = _provider(fake_llm)
    call = asyncio.create_task(
        provider.chat_with_retry(messages=[{"role": "user", "content": "block"}])
    )
    assert await asyncio.to_thread(fake_llm.started.wait, 5)
    call.cancel()
    await asyncio.sleep(0)  # one step of the event loop
    assert call.cancelled()


async def test_cancelling_the_turn_cancels_the_http_call(fake_llm: FakeLLM) -> None:
    provider = _provider(fake_llm)
    call = asyncio.create_task(
        provider.chat_with_retry(messages=[{"role": "user", "content": "block"}])
    )
    assert await asyncio.to_thread(fake_llm.started.wait, 5)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(call, 2)  # the server is still holding the request

    def hung_up() -> bool:  # the HTTP request itself was closed, not just our task
        deadline = time.monotonic() + 5
        while fake_llm.hangups == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        return fake_llm.hangups == 1

    assert await asyncio.to_thread(hung_up)


async def test_echo_calls_offered_tools_only() -> None:
    echo = EchoProvider()
    tools = [{"type": "function", "function": {"name": "read_session", "parameters": {}}}]
    called = await echo.chat_with_retry(
        messages=[{"role": "user", "content": "/tool read_session {}"}], tools=tools
    )
    assert [c.name for c in called.tool_calls] == ["read_session"]
    refused = await echo.chat_with_retry(
        messages=[{"role": "user", "content": "/tool spawn {}"}], tools=tools
    )
    assert refused.tool_calls == []


async def test_streamed_deltas_reach_the_frontend_before_the_answer(
    redis_factory, fake_llm: FakeLLM
) -> None:  # type: ignore[no-untyped-def]
    from replies import collect

    from bus_redis import FrontendClient, InboundMessage, RedisBus
    from worker import AgentLoop, LoopConfig

    config = LoopConfig(stream_deltas=True, read_block_ms=100)
    loop = AgentLoop(RedisBus(redis_factory()), _provider(fake_llm), config=config)
    client = FrontendClient(redis_factory())
    task = asyncio.create_task(loop.run())
    mid = await client.send(
        InboundMessage(id="s1", channel="web", sender_id="u", chat_id="d", content="stream me")
    )
    got = await collect(client, "web", {mid})
    loop.stop()
    await asyncio.wait_for(task, 10)

    deltas = [ev.content for ev in got[mid] if ev.type == "delta"]
    assert len(deltas) > 1
    assert "".join(deltas) == got[mid][-1].content == "re: stream me"
    assert fake_llm.requests[0]["stream"] is True


async def test_rate_limit_waits_retry_after_then_answers(fake_llm: FakeLLM) -> None:
    provider = OpenAIProvider("m", base_url=fake_llm.base_url, backoff_s=30)  # Retry-After: 0 wins
    retries: list[int] = []
    provider.on_retry = lambda: retries.append(1)
    resp = await asyncio.wait_for(
        provider.chat_with_retry(messages=[{"role": "user", "content": "status:429 hi"}]), 10
    )
    assert resp.content == "re: status:429 hi"
    assert retries == [1]
    assert len(fake_llm.requests) == 2


@pytest.mark.parametrize(
    ("status", "name"),
    [(400, "BadRequestError"), (401, "AuthenticationError"), (404, "NotFoundError")],
)
async def test_client_errors_fail_at_once_with_the_servers_message(
    fake_llm: FakeLLM, status: int, name: str
) -> None:
    with pytest.raises(ProviderError) as err:
        await _provider(fake_llm).chat_with_retry(
            messages=[{"role": "user", "content": f"status:{status}"}]
        )
    assert str(err.value) == f"{name}: HTTP {status}: scripted status:{status}"
    assert len(fake_llm.requests) == 1


async def test_a_body_that_is_not_json_is_a_provider_error(fake_llm: FakeLLM) -> None:
    with pytest.raises(ProviderError, match="APIResponseValidationError"):
        await _provider(fake_llm).chat_with_retry(messages=[{"role": "user", "content": "garbage"}])


@pytest.mark.parametrize("streamed", [False, True])
async def test_tool_calls_are_parsed_plain_and_streamed(fake_llm: FakeLLM, streamed: bool) -> None:
    deltas: list[str] = []

    async def on_delta(text: str) -> None:
        deltas.append(text)

    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    resp = await _provider(fake_llm).chat_with_retry(
        messages=[{"role": "user", "content": "toolcall:lookup"}],
        tools=tools,
        on_delta=on_delta if streamed else None,
    )
    assert [(c.id, c.name, c.arguments) for c in resp.tool_calls] == [
        ("call_1", "lookup", {"a": 1})
    ]
    assert resp.finish_reason == "tool_calls"
    assert deltas == []
    assert fake_llm.requests[0]["tools"] == tools


async def test_a_stream_cut_after_its_first_pieces_is_not_retried(fake_llm: FakeLLM) -> None:
    """A retry would send the answer's beginning again: once a delta went out, a broken
    stream is a provider error."""
    deltas: list[str] = []

    async def on_delta(text: str) -> None:
        deltas.append(text)

    with pytest.raises(ProviderError, match="after the answer began"):
        await _provider(fake_llm).chat_with_retry(
            messages=[{"role": "user", "content": "cutstream please"}], on_delta=on_delta
        )
    assert deltas == ["re: ", "cuts"]
    assert len(fake_llm.requests) == 1


async def test_an_answer_trickled_past_the_deadline_is_a_timeout_and_retried(
    fake_llm: FakeLLM,
) -> None:
    """Each byte comes well within the read timeout, the whole body (~5 s) not within the
    call's deadline: the call is a timeout, retried like one, never a wait until the
    server is done."""
    provider = _provider(fake_llm, timeout_s=5.0, deadline_s=0.3, max_retries=1)
    with pytest.raises(
        ProviderError,
        match=r"APITimeoutError: the deadline passed, no complete answer within 0\.3 s \(2 attempts\)",
    ):
        await provider.chat_with_retry(messages=[{"role": "user", "content": "trickle"}])
    assert len(fake_llm.requests) == 2
    # endless interim heads (100 Continue) the same
    with pytest.raises(
        ProviderError,
        match=r"APITimeoutError: the deadline passed, no complete answer within 0\.3 s \(2 attempts\)",
    ):
        await provider.chat_with_retry(messages=[{"role": "user", "content": "continues"}])
    assert len(fake_llm.requests) == 4
    await provider.aclose()


async def test_a_stream_trickled_past_the_deadline_ends_as_begun(fake_llm: FakeLLM) -> None:
    """A streamed answer that began keeps its first pieces and is not retried (a retry
    would send its beginning again); one that is complete is never failed."""
    provider = _provider(fake_llm, timeout_s=5.0, deadline_s=0.3, max_retries=1)
    deltas: list[str] = []

    async def on_delta(text: str) -> None:
        deltas.append(text)

    with pytest.raises(ProviderError, match=r"within 0\.3 s .*after the answer began"):
        await provider.chat_with_retry(
            messages=[{"role": "user", "content": "trickle " + "x" * 200}], on_delta=on_delta
        )
    assert deltas  # the answer began
    assert "".join(deltas) != "re: trickle " + "x" * 200  # and did not end
    assert len(fake_llm.requests) == 1
    patient = _provider(fake_llm, deadline_s=30)
    answer = await patient.chat_with_retry(
        messages=[{"role": "user", "content": "trickle"}], on_delta=on_delta
    )
    assert answer.content == "re: trickle"
    await provider.aclose()
    await patient.aclose()


async def test_a_whole_answer_to_a_stream_is_given_once_the_exchange_is_over(
    fake_llm: FakeLLM,
) -> None:
    """A server that ignored ``stream`` answered whole: its one delta goes out after the
    exchange, outside the deadline, so a slow delivery never times the answer out and
    has it asked for (and given) again."""
    provider = _provider(fake_llm, deadline_s=0.3, max_retries=2)
    deltas: list[str] = []

    async def slow_delivery(text: str) -> None:
        await asyncio.sleep(0.5)  # longer than the deadline (a slow sink, not a sync)
        deltas.append(text)

    answer = await provider.chat_with_retry(
        messages=[{"role": "user", "content": "nostream please"}], on_delta=slow_delivery
    )
    assert answer.content == "re: nostream please"
    assert deltas == ["re: nostream please"]
    assert len(fake_llm.requests) == 1
    await provider.aclose()


async def test_a_body_that_cannot_be_decoded_is_retried_then_reported(fake_llm: FakeLLM) -> None:
    with pytest.raises(ProviderError, match="APIConnectionError"):
        await _provider(fake_llm, max_retries=1).chat_with_retry(
            messages=[{"role": "user", "content": "badgzip"}]
        )
    assert len(fake_llm.requests) == 2


async def test_a_server_that_ignores_stream_answers_in_one_delta(fake_llm: FakeLLM) -> None:
    deltas: list[str] = []

    async def on_delta(text: str) -> None:
        deltas.append(text)

    resp = await _provider(fake_llm).chat_with_retry(
        messages=[{"role": "user", "content": "nostream"}], on_delta=on_delta
    )
    assert resp.content == "re: nostream"
    assert deltas == ["re: nostream"]


async def _streamed(provider: OpenAIProvider, text: str) -> tuple[str, list[str]]:
    pieces: list[str] = []

    async def sink(piece: str) -> None:
        pieces.append(piece)

    answer = await provider.chat_with_retry(
        messages=[{"role": "user", "content": text}], on_delta=sink
    )
    return answer.content or "", pieces


async def test_streamed_calls_keep_their_connection(fake_llm: FakeLLM) -> None:
    """The body's end after ``[DONE]`` is read, so the connection goes back to the pool:
    one TCP (and, against a real server, TLS) handshake for many streamed calls."""
    from worker.agent.providers.openai_provider import POOL_SHARDS

    provider = _provider(fake_llm)
    for i in range(3 * POOL_SHARDS):  # calls go round the pool's shards (clients)
        content, pieces = await _streamed(provider, f"stream {i}")
        assert content == "".join(pieces) == f"re: stream {i}"
    assert fake_llm.connections == POOL_SHARDS  # one each, kept


async def test_a_server_that_stalls_or_talks_after_done_costs_its_connection_only(
    fake_llm: FakeLLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    import worker.agent.providers.openai_provider as module

    monkeypatch.setattr(module, "AFTER_DONE_S", 0.05)
    provider = _provider(fake_llm)
    # the body never ends after [DONE]: the answer is complete, the call returns while
    # the server still holds it (it holds for 30 s; wait_for only catches a hang)
    content, _ = await asyncio.wait_for(_streamed(provider, "stalldone"), 10)
    assert content == "re: stalldone"
    fake_llm.release()
    # 100 KiB after [DONE]: read up to the bound, then the connection is dropped
    content, _ = await _streamed(provider, "chatterdone")
    assert content == "re: chatterdone"
    before = fake_llm.connections
    assert (await _streamed(provider, "after"))[0] == "re: after"
    assert fake_llm.connections == before + 1  # the talkative one's connection was not kept
    # the connection breaks after [DONE]: the answer stands (no error, no second call)
    calls = len(fake_llm.requests)
    content, pieces = await _streamed(provider, "cutdone")
    assert content == "".join(pieces) == "re: cutdone"
    assert len(fake_llm.requests) == calls + 1


@pytest.mark.parametrize("encoding", ["gzipped", "deflated", "mislabelled"])
async def test_a_compressed_body_is_decoded(fake_llm: FakeLLM, encoding: str) -> None:
    """gzip (here in two members) and deflate are asked for and decoded; a coding the
    client does not know leaves the body as it is, as httpx does."""
    resp = await _provider(fake_llm).chat_with_retry(
        messages=[{"role": "user", "content": encoding}]
    )
    assert resp.content == f"re: {encoding}"
    assert fake_llm.headers[0]["accept-encoding"] == "gzip, deflate"


def _no_proxies(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)


async def test_the_environments_proxy_carries_the_call_unless_no_proxy_names_the_host(
    fake_llm: FakeLLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As with httpx's ``trust_env``: HTTP_PROXY (with its credentials) is used for an
    http:// server, NO_PROXY bypasses it. The fake server is the proxy here; the server
    named in the URL listens nowhere, so only a proxied call is answered."""
    from servers import free_port

    _no_proxies(monkeypatch)
    proxy_port = fake_llm.server.server_address[1]
    monkeypatch.setenv("HTTP_PROXY", f"http://bench%3Auser:p%40ss@127.0.0.1:{proxy_port}")
    upstream = f"http://127.0.0.1:{free_port()}/v1"
    provider = OpenAIProvider("m", base_url=upstream, backoff_s=0.01, max_retries=0)
    resp = await provider.chat_with_retry(messages=[{"role": "user", "content": "via proxy"}])
    assert resp.content == "re: via proxy"
    assert fake_llm.paths == [upstream + "/chat/completions"]  # the absolute form
    basic = "Basic " + base64.b64encode(b"bench:user:p@ss").decode()
    assert fake_llm.headers[0]["proxy-authorization"] == basic
    await provider.aclose()

    for no_proxy in ("example.org,127.0.0.1", "127.0.0.0/8"):  # httpx's rules: CIDR too
        monkeypatch.setenv("NO_PROXY", no_proxy)
        direct = OpenAIProvider("m", base_url=upstream, backoff_s=0.01, max_retries=0)
        with pytest.raises(ProviderError, match="APIConnectionError"):
            await direct.chat_with_retry(messages=[{"role": "user", "content": "direct"}])
        assert len(fake_llm.paths) == 1  # the proxy saw nothing more
        await direct.aclose()


async def test_the_url_is_sent_as_httpx_would_send_it(fake_llm: FakeLLM) -> None:
    """Percent-encoded, the Host with its port, and credentials in it as Basic auth."""
    port = fake_llm.server.server_address[1]
    url = f"http://us%3Aer:p%40ss@localhost:{port}/my models/v1"
    provider = OpenAIProvider("m", base_url=url, api_key="k", backoff_s=0.01)
    resp = await provider.chat_with_retry(messages=[{"role": "user", "content": "hi"}])
    assert resp.content == "re: hi"
    assert fake_llm.paths == ["/my%20models/v1/chat/completions"]
    headers = fake_llm.headers[0]
    assert headers["host"] == f"localhost:{port}"
    assert headers["authorization"] == "Basic " + base64.b64encode(b"us:er:p@ss").decode()
    await provider.aclose()


@pytest.mark.parametrize(
    "url", ["ftp://127.0.0.1/v1", "http:///v1", "http://127.0.0.1:port/v1", "http://[::1]:99999/v1"]
)
async def test_a_url_that_cannot_be_used_fails_at_once(fake_llm: FakeLLM, url: str) -> None:
    provider = OpenAIProvider("m", base_url=url, backoff_s=0.01, max_retries=3)
    with pytest.raises(ProviderError, match=r"APIConnectionError: .*URL"):
        await provider.chat_with_retry(messages=[{"role": "user", "content": "x"}])
    assert fake_llm.requests == []


async def test_a_body_past_the_bound_fails_the_call_not_the_workers_memory(
    fake_llm: FakeLLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A small gzip body may inflate to anything: what is read of a body, decoded, is
    bounded, plain and streamed; past it the call fails, unretried."""
    import worker.agent.providers.http as http

    monkeypatch.setattr(http, "MAX_BODY_BYTES", 200)
    provider = _provider(fake_llm, max_retries=3)
    # inflates past the bound; a body that inflates to (nearly) nothing counts its bytes
    # sent; a stream
    cases = (("gzipped " + "x" * 300, None), ("emptystored", None), ("chatterdone", _sink))
    for text, on_delta in cases:
        with pytest.raises(ProviderError, match="larger than 200 bytes"):
            await provider.chat_with_retry(
                messages=[{"role": "user", "content": text}], on_delta=on_delta
            )
    assert len(fake_llm.requests) == 3  # none was retried
    monkeypatch.setattr(http, "MAX_BODY_BYTES", 1 << 20)
    assert (await _streamed(provider, "after"))[0] == "re: after"
    answer = await provider.chat_with_retry(messages=[{"role": "user", "content": "emptystored"}])
    assert answer.content == "re: emptystored"  # within the bound it decodes


async def _sink(_piece: str) -> None:
    return None


async def test_a_request_leaves_in_one_write() -> None:
    """httpcore writes a request's head and body apart; they reach the socket in one
    write, at the connection's next read (one system call and one segment, not two)."""
    from worker.agent.providers.wire import HeldWrites

    class Recording:
        def __init__(self) -> None:
            self.calls: list[tuple[str, bytes]] = []

        async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109
            self.calls.append(("write", buffer))

        async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:  # noqa: ASYNC109
            self.calls.append(("read", b""))
            return b"answer"

    inner = Recording()
    stream = HeldWrites(inner)  # type: ignore[arg-type]
    await stream.write(b"HEAD\r\n\r\n")
    await stream.write(b"BODY")
    assert inner.calls == []
    assert await stream.read(100) == b"answer"
    assert inner.calls == [("write", b"HEAD\r\n\r\nBODY"), ("read", b"")]
    assert await stream.read(100) == b"answer"  # nothing held: nothing written
    assert inner.calls[2:] == [("read", b"")]


def test_no_coding_makes_more_than_the_bound() -> None:
    """A gzip body of gzip (1,827 bytes for 1 GiB) never inflates past the limit in any
    stage; raw deflate is told from zlib-wrapped by its first two bytes, however the body
    is cut; bytes after a gzip member that start no other are ignored."""
    import gzip
    import zlib

    from worker.agent.providers.wire import BodyTooLargeError, Decoder

    zeros = gzip.compress(b"\0" * (64 << 20))
    bomb = gzip.compress(zeros)
    with pytest.raises(BodyTooLargeError):
        Decoder("gzip, gzip", 1 << 20)(bomb)
    with pytest.raises(BodyTooLargeError):
        Decoder("gzip", 1 << 20)(zeros)
    body = b'{"answer": "' + b"ok " * 50 + b'"}'
    z = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    raw = z.compress(body) + z.flush()
    for cut in (1, 2, 7):
        decode = Decoder("deflate", 1 << 20)
        out = b"".join(decode(raw[i : i + cut]) for i in range(0, len(raw), cut))
        assert out + decode(None) == body
    decode = Decoder("gzip", 1 << 20)
    assert decode(gzip.compress(body) + b"\0" * 8) + decode(None) == body
