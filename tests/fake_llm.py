"""A local OpenAI-compatible chat server for tests (stdlib HTTP, one thread per request).

It answers ``re: <last user text>``. A user text ``[tag] ...`` marks the session ``tag``:
two requests of one tag in flight at once are counted as an overlap. ``block`` in the
text holds the request until ``release()``; ``midway`` streams the first two pieces of
the answer, then holds the rest until ``release()``; ``fail`` answers HTTP 500; ``flaky``
answers HTTP 500 to the first ``flaky_failures`` requests with that text, then normally;
``status:<code>`` answers that status once per text (then normally), with
``Retry-After: 0`` on a 429 or 503; ``toolcall:<name>`` answers a call of tool ``name`` with arguments
``{"a": 1}``, ``toolcall:<name>{...}`` with those (plain or streamed in pieces); ``garbage`` answers 200 with a body that is not
JSON; ``badgzip`` says ``Content-Encoding: gzip`` of a body that is not; ``gzipped`` and
``deflated`` answer a plain body that is (raw deflate for the latter; gzip in two
members; ``emptystored``: raw deflate after 1,000 empty stored blocks); ``mislabelled`` says ``Content-Encoding: br`` of a plain body; ``nostream``
answers plain JSON to a streaming request; ``cutstream`` drops the connection after two
pieces of a streamed answer; ``stalldone`` holds the body's end after ``[DONE]`` until
``release()``; ``chatterdone`` sends 100 KiB of comment lines after ``[DONE]``; ``cutdone``
drops the connection right after ``[DONE]`` (the body never ends); ``trickle`` sends a
plain answer's body a byte every 20 ms, a streamed answer's pieces after the first one
every 50 ms (each within any read timeout, the whole far longer than a short deadline);
``continues`` sends a ``100 Continue`` head every 20 ms for 10 s before its answer.
``connections`` counts the TCP connections accepted; ``paths`` holds each request's target
(an absolute URL when it came through a proxy), ``headers`` its headers.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import random
import re
import select
import socket
import sys
import threading
import time
import zlib
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_TAG = re.compile(r"^\[([^\]]+)\]")
_STATUS = re.compile(r"status:(\d{3})")
_TOOLCALL = re.compile(r"toolcall:(\w+)(\{[^}]*\})?")


class _Server(ThreadingHTTPServer):
    fake: FakeLLM
    request_queue_size = 128  # 64 clients connecting at once (socketserver's default: 5)

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a kept-alive client left
            super().handle_error(request, client_address)


class FakeLLM:
    def __init__(self, *, latency_s: tuple[float, float] = (0.0, 0.0)) -> None:
        self.latency_s = latency_s
        self.requests: list[dict[str, Any]] = []
        self.paths: list[str] = []
        self.headers: list[dict[str, str]] = []  # each request's headers (names in lower case)
        self.inflight: dict[str, int] = {}
        self.overlaps = 0
        self.hangups = 0  # held requests whose client closed the connection
        self.connections = 0  # accepted (a client that keeps its connection opens one)
        self.flaky_failures = 4  # a worker's provider tries 1 + 3 times a turn
        self._flaky: dict[str, int] = {}
        self.started = threading.Event()
        self.on_block: Callable[[str], object] | None = None  # told each held request's text
        self._release = threading.Event()
        self._lock = threading.Lock()
        self.server = _Server(("127.0.0.1", 0), _Handler)
        self.server.fake = self
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def start(self) -> FakeLLM:
        self.thread.start()
        return self

    def stop(self) -> None:
        self._release.set()
        self.server.shutdown()
        self.server.server_close()

    def release(self) -> None:
        self._release.set()

    def rearm(self) -> None:
        """Hold ``block`` / ``midway`` requests again (after a ``release()``)."""
        self._release.clear()
        self.started.clear()

    def _hold(self, conn: socket.socket | None) -> bool:
        """Hold a ``block`` request until ``release()``; False when the client hangs up."""
        while not self._release.wait(0.02):
            if conn is None:
                continue
            readable, _, _ = select.select([conn], [], [], 0)
            if readable and conn.recv(1, socket.MSG_PEEK) == b"":
                with self._lock:
                    self.hangups += 1
                return False
        return True

    def _failure(self, text: str) -> tuple[int, dict[str, Any]] | None:
        """The scripted failure of this text, if any (see the module's docstring)."""
        if "fail" in text:
            return 500, {"error": {"message": "scripted failure", "type": "server_error"}}
        if "flaky" in text:
            with self._lock:
                self._flaky[text] = self._flaky.get(text, 0) + 1
                failing = self._flaky[text] <= self.flaky_failures
            if failing:
                return 500, {"error": {"message": "flaky failure", "type": "server_error"}}
        status = _STATUS.search(text)
        if status:
            with self._lock:
                self._flaky[text] = self._flaky.get(text, 0) + 1
                once = self._flaky[text] == 1
            if once:
                return int(status.group(1)), {"error": {"message": f"scripted {text}"}}
        if "garbage" in text:
            return 200, {"garbage": True}
        return None

    def _answer(
        self, body: dict[str, Any], conn: socket.socket | None = None
    ) -> tuple[int, dict[str, Any]]:
        user = next((m for m in reversed(body.get("messages", [])) if m.get("role") == "user"), {})
        text = str(user.get("content", ""))
        match = _TAG.match(text)
        tag = match.group(1) if match else ""
        with self._lock:
            self.requests.append(body)
            self.inflight[tag] = self.inflight.get(tag, 0) + 1
            if tag and self.inflight[tag] > 1:
                self.overlaps += 1
        try:
            if "block" in text:
                self.started.set()
                if self.on_block is not None:
                    self.on_block(text)
                if not self._hold(conn):
                    return 499, {"error": {"message": "client closed the request"}}
            low, high = self.latency_s
            if high > 0:
                time.sleep(random.uniform(low, high))
            failure = self._failure(text)
            if failure is not None:
                return failure
            message: dict[str, Any] = {"role": "assistant", "content": f"re: {text}"}
            call = _TOOLCALL.search(text)
            if call and body.get("messages", [])[-1].get("role") != "tool":
                message = {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {
                                "name": call.group(1),
                                "arguments": call.group(2) or '{"a": 1}',
                            },
                        }
                    ],
                }
            finish = "tool_calls" if message.get("tool_calls") else "stop"
            return 200, {
                "id": "chatcmpl-test",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.get("model", "fake"),
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        finally:
            with self._lock:
                self.inflight[tag] -= 1


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    protocol_version = "HTTP/1.1"  # keep-alive, as real servers do
    wbufsize = 1 << 16  # headers and body leave in one write (flushed after the request)

    def setup(self) -> None:
        super().setup()  # no Nagle delay (~40 ms per call) between header and body
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self.server.fake._lock:
            self.server.fake.connections += 1

    def do_POST(self) -> None:
        self.server.fake.paths.append(self.path)
        self.server.fake.headers.append({k.lower(): v for k, v in self.headers.items()})
        length = int(self.headers.get("Content-Length", "0"))
        body = json.loads(self.rfile.read(length) or b"{}")
        status, doc = self.server.fake._answer(body, self.connection)
        text = json.dumps(doc)
        if body.get("stream") and status == 200 and "choices" in doc and "nostream" not in text:
            self._stream(doc)
            return
        with contextlib.suppress(OSError):  # the worker cancelled the request
            self._reply(status, doc)

    def _reply(self, status: int, doc: dict[str, Any]) -> None:
        data = b"<html>not json" if "garbage" in doc else json.dumps(doc).encode()
        if b"continues" in data:
            for _ in range(500):  # interim heads, each within any read timeout
                self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                self.wfile.flush()
                time.sleep(0.02)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        if "badgzip" in data.decode(errors="replace"):
            self.send_header("Content-Encoding", "gzip")  # the body is not gzip
        elif "gzipped" in data.decode(errors="replace"):
            self.send_header("Content-Encoding", "gzip")
            data = gzip.compress(data[:10]) + gzip.compress(data[10:])  # in two members
        elif "emptystored" in data.decode(errors="replace"):
            self.send_header("Content-Encoding", "deflate")
            z = zlib.compressobj(wbits=-zlib.MAX_WBITS)
            empty = b"\x00\x00\x00\xff\xff" * 1000  # stored, not final, no bytes
            data = empty + z.compress(data) + z.flush()
        elif "mislabelled" in data.decode(errors="replace"):
            self.send_header("Content-Encoding", "br")  # the body is plain
        elif "deflated" in data.decode(errors="replace"):
            self.send_header("Content-Encoding", "deflate")
            z = zlib.compressobj(wbits=-zlib.MAX_WBITS)  # raw, as some servers send it
            data = z.compress(data) + z.flush()
        if status in (429, 503):
            self.send_header("Retry-After", "0")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if b"trickle" in data:
            for i in range(len(data)):
                self.wfile.write(data[i : i + 1])
                self.wfile.flush()
                time.sleep(0.02)  # a slow server (an OSError ends it: the client left)
            return
        self.wfile.write(data)
        self.wfile.flush()

    def _stream(self, doc: dict[str, Any]) -> None:
        message = doc["choices"][0]["message"]
        text = message["content"] or ""
        pieces = _pieces(message)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")  # the connection stays open
        self.end_headers()
        midway = "midway" in text
        for n, piece in enumerate([*pieces, None]):
            if "cutstream" in text and n == 2:
                self.close_connection = True  # the connection drops mid-answer
                return
            if "trickle" in text and n >= 1:
                time.sleep(0.05)  # a slow server
            if midway and n == 2:
                self.wfile.flush()
                self.server.fake.started.set()
                self.server.fake._release.wait(30)
            if isinstance(piece, dict):
                delta: dict[str, Any] = {"tool_calls": [piece]}
            else:
                delta = {"content": piece} if piece is not None else {}
            finish = None
            if piece is None:
                finish = "tool_calls" if message.get("tool_calls") else "stop"
            chunk = {
                "id": "chatcmpl-test",
                "object": "chat.completion.chunk",
                "created": 0,
                "model": doc["model"],
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            }
            self._chunk(f"data: {json.dumps(chunk)}\n\n".encode())
        self._chunk(b"data: [DONE]\n\n")
        if "stalldone" in text:
            self.wfile.flush()
            self.server.fake._release.wait(30)
        if "cutdone" in text:
            self.wfile.flush()
            self.close_connection = True
            return
        if "chatterdone" in text:
            for _ in range(100):
                self._chunk(b": keep-alive " + b"x" * 1010 + b"\n")
        self._chunk(b"")

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def log_message(self, format: str, *args: Any) -> None:
        return


def _pieces(message: dict[str, Any]) -> list[Any]:
    """A streamed answer's deltas: the text in pieces of 4 characters, then each tool call
    as its name, then its arguments in two halves."""
    text = message["content"] or ""
    pieces: list[Any] = [text[i : i + 4] for i in range(0, len(text), 4)]
    for call in message.get("tool_calls") or ():
        args = call["function"]["arguments"]
        half = len(args) // 2
        pieces += [
            {"index": 0, "id": call["id"], "function": {"name": call["function"]["name"]}},
            {"index": 0, "function": {"arguments": args[:half]}},
            {"index": 0, "function": {"arguments": args[half:]}},
        ]
    return pieces
