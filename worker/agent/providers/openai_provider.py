"""OpenAIProvider: any OpenAI-compatible chat API (OpenAI, vLLM, Ollama, OpenRouter, LiteLLM).

It speaks the chat-completions wire format over pooled HTTP connections (``http.py``): the
request is the JSON the turn built, the answer is read as plain JSON. The openai SDK
cost 8-20 ms CPU per call (its recursive request transform and response models), more
than the rest of a turn together, and httpx's request layers ~0.3 ms; this path costs
about what the HTTP exchange does.

A request has ``timeout_s`` for each step (each read and write: the longest silence;
connecting, at most 10 s) and ``deadline_s`` from its start to the answer's end: a server
that trickles its answer a byte at a time, or sends endless interim heads, is a timeout
too, not a call that runs until the body bound (8 MiB) is read. The deadline is each
attempt's: with retries, a call takes at most (retries + 1) x deadline plus the backoffs.

Retries 408, 409, 429, 5xx, timeouts and connection errors with exponential backoff (or
the server's ``Retry-After``, up to a minute); every other status fails at once, with
the server's error message. Error names follow the openai SDK's (``RateLimitError``,
``InternalServerError``, ``APIConnectionError``, ...). Cancellation of the awaiting task
ends the call at once and closes its HTTP request in the background.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from bus_redis.codec import safe
from worker.agent.providers.answers import StreamedAnswer, error_message, parse_answer
from worker.agent.providers.base import (
    DeltaCallback,
    GenerationSettings,
    LLMResponse,
    ProviderError,
    left_when_cancelled,
)
from worker.agent.providers.http import HTTPClient, HTTPError

log = logging.getLogger(__name__)

DEFAULT_BASE_URL = "https://api.openai.com/v1"
MAX_RETRY_AFTER_S = 60.0
POOL_SHARDS = 16
# after a stream's [DONE], what is read of the body's end so that its connection goes back
# to the pool (a body left unread closes the connection: a new TCP, and TLS, handshake for
# the next call); a server that keeps talking or stalls loses the connection instead
AFTER_DONE_BYTES = 65_536
AFTER_DONE_S = 1.0
CONNECTIONS_PER_SHARD = 8
_STATUS_NAMES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    409: "ConflictError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
}


class _RetryableError(Exception):
    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class OpenAIProvider:
    def __init__(
        self,
        model: str,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout_s: float = 120.0,
        deadline_s: float = 600.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        generation: GenerationSettings | None = None,
        max_connections: int = 256,
    ) -> None:
        self.model = model
        self.generation = generation or GenerationSettings()
        self.deadline_s = deadline_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.on_retry: Callable[[], object] | None = None  # counts retries (worker metrics)
        # explicit: an empty OPENAI_BASE_URL in the environment would otherwise win
        self.url = (base_url or DEFAULT_BASE_URL).rstrip("/") + "/chat/completions"
        self.http = HTTPClient(
            self.url,
            headers={
                "Authorization": f"Bearer {api_key or 'not-needed'}",
                "Content-Type": "application/json",
                "Accept": "application/json",
                "User-Agent": "redis-agent-worker",
            },
            timeout_s=timeout_s,
            connect_s=min(timeout_s, 10.0),
            max_connections=max_connections,
            shards=max(1, min(POOL_SHARDS, max_connections // CONNECTIONS_PER_SHARD)),
        )

    def get_default_model(self) -> str:
        return self.model

    async def aclose(self) -> None:
        await self.http.aclose()

    async def chat_with_retry(
        self,
        *,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        model: str | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        on_delta: DeltaCallback | None = None,
    ) -> LLMResponse:
        body: dict[str, Any] = {
            "model": model or self.model,
            "messages": messages,
            "max_tokens": max_tokens or self.generation.max_tokens,
            "temperature": self.generation.temperature if temperature is None else temperature,
        }
        if tools:
            body["tools"] = tools
        if on_delta is not None:
            body["stream"] = True
        content = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
        for attempt in range(self.max_retries + 1):
            try:
                if on_delta is not None:
                    return await left_when_cancelled(self._stream(content, on_delta))
                return await left_when_cancelled(self._post(content))
            except _RetryableError as exc:
                if attempt == self.max_retries:
                    tries = f" ({attempt + 1} attempts)" if attempt else ""
                    raise ProviderError(f"{exc}{tries}") from exc
                delay = exc.retry_after_s
                if delay is None:
                    delay = self.backoff_s * 2**attempt * (0.5 + random.random())
                if self.on_retry is not None:
                    self.on_retry()
                # the kind and status only: a server's message may quote the request (a
                # private session's text is never logged)
                kind = ":".join(str(exc).split(":", 2)[:2])
                log.warning("provider retry %d in %.2fs: %s", attempt + 1, delay, safe(kind))
                await asyncio.sleep(delay)
        raise ProviderError("unreachable")

    def _overdue(self) -> str:
        return (
            f"APITimeoutError: the deadline passed, no complete answer within {self.deadline_s:g} s"
        )

    async def _post(self, content: bytes) -> LLMResponse:
        deadline = asyncio.timeout(self.deadline_s)
        try:
            async with deadline:
                status, headers, body = await self.http.post(content)
        except HTTPError as exc:
            raise _failure(exc) from exc
        except TimeoutError as exc:
            if not deadline.expired():
                raise
            raise _RetryableError(self._overdue()) from exc
        if status != 200:
            _fail(status, headers, body)
        try:
            return parse_answer(json.loads(body))
        except (ValueError, LookupError, TypeError, AttributeError, RecursionError) as exc:
            raise ProviderError(f"APIResponseValidationError: {_short(exc)}") from exc

    async def _stream(self, content: bytes, on_delta: DeltaCallback) -> LLMResponse:
        """Deltas reach ``on_delta`` as they come. Once one has, a failure is not retried
        (a retry would send the answer's beginning again): it is a ProviderError."""
        stream = StreamedAnswer(on_delta)
        deadline = asyncio.timeout(self.deadline_s)
        try:
            async with deadline:
                answer = await self._read_stream(content, stream)
            if answer is not None:  # the server ignored "stream": one answer, one delta,
                if answer.content:  # given once the exchange is over (never retried after)
                    await on_delta(answer.content)
                return answer
        except (HTTPError, TimeoutError) as exc:
            if isinstance(exc, TimeoutError):
                if not deadline.expired():
                    raise
                if stream.complete:  # it ran out while the body's end was read
                    return stream.result()
            error = (
                _failure(exc) if isinstance(exc, HTTPError) else _RetryableError(self._overdue())
            )
            if stream.started and isinstance(error, _RetryableError):
                raise ProviderError(f"{error} (after the answer began)") from exc
            raise error from exc
        except (ValueError, LookupError, AttributeError, TypeError, RecursionError) as exc:
            raise ProviderError(f"APIResponseValidationError: {_short(exc)}") from exc
        if not stream.complete:
            message = "APIConnectionError: the stream ended before the answer did"
            if stream.started:
                raise ProviderError(message)
            raise _RetryableError(message)
        try:
            return stream.result()
        except (ValueError, LookupError, AttributeError, TypeError, RecursionError) as exc:
            raise ProviderError(f"APIResponseValidationError: {_short(exc)}") from exc

    async def _read_stream(self, content: bytes, stream: StreamedAnswer) -> LLMResponse | None:
        """One streamed exchange into ``stream``; the answer when the server sent it whole
        (not given to ``on_delta`` yet)."""
        async with self.http.stream(content) as response:
            if response.status != 200:
                _fail(response.status, response.headers, await response.read())
            if not response.headers.get("content-type", "").startswith("text/event-stream"):
                return parse_answer(json.loads(await response.read()))  # "stream" ignored
            lines = response.lines()
            async for line in lines:
                if not await stream.line(line):
                    break
            if stream.done:
                await _read_to_end(lines)
        return None


async def _read_to_end(lines: AsyncIterator[str]) -> None:
    """Read what follows ``[DONE]`` (the body's end, normally nothing), so that the
    connection is kept; at most ``AFTER_DONE_BYTES`` (in lines) and ``AFTER_DONE_S``,
    then the connection is dropped instead. The answer is complete either way: a
    connection that breaks here costs only itself."""
    left = AFTER_DONE_BYTES
    try:
        async with asyncio.timeout(AFTER_DONE_S):
            async for line in lines:
                left -= len(line) + 1
                if left < 0:
                    return
    except (TimeoutError, HTTPError):
        return


def _failure(exc: HTTPError) -> Exception:
    """What a failed HTTP exchange becomes: timeouts and transport or decoding failures are
    retried; a URL that cannot be used is not."""
    return _RetryableError(str(exc)) if exc.retryable else ProviderError(str(exc))


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:200]}"


def _fail(status: int, headers: Mapping[str, str], body: bytes) -> None:
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        doc = body.decode("utf-8", "replace")[:500]
    name = _STATUS_NAMES.get(status, "InternalServerError" if status >= 500 else "APIStatusError")
    message = f"{name}: HTTP {status}: {error_message(doc)}"
    if status in (408, 409, 429) or status >= 500:
        raise _RetryableError(message, _retry_after(headers))
    raise ProviderError(message)


def _retry_after(headers: Mapping[str, str]) -> float | None:
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        raw = headers.get(name)
        if raw is None:
            continue
        try:
            value = float(raw) * scale
        except ValueError:
            continue  # an HTTP date: use our own backoff
        if 0 <= value <= MAX_RETRY_AFTER_S:
            return value
    return None
