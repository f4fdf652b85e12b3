"""BoundedHead: uvicorn's httptools protocol with a bound on a request's head.

httptools buffers a request line and headers of any size until the head is complete, so
one connection, credentials or not, could make the gateway hold memory in proportion to
what it sent. A head still incomplete past ``HEAD_MAX_BYTES`` is answered 431 and the
connection closed (h11, uvicorn's other protocol, has ``h11_max_incomplete_event_size``
for this; httptools has nothing). Counted from the reads that continue a head (the read
that begins one may also hold the previous request's body), so at most one read's worth
(asyncio reads up to 256 KiB) more is ever held.
"""

from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

HEAD_MAX_BYTES = 64 * 1024  # nginx's default is 4 x 8 KiB: this is well above it
_BODY = b"request head too large"
_REFUSAL = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain\r\n"
    b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(_BODY), _BODY)
)


class BoundedHead(HttpToolsProtocol):
    _in_head = False
    _head_bytes = 0
    _heads = 0  # heads begun on this connection

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head_bytes = True, 0
        self._heads += 1

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()

    def data_received(self, data: bytes) -> None:
        same_head = self._in_head, self._heads
        super().data_received(data)
        if not self._in_head or self.transport.is_closing():
            return
        # only a read that began and ended within one head is all of it: a head that began
        # in this read is counted from the next one (the read may also hold the end of
        # the previous request, its body, pipelining: no part of this head)
        if same_head == (True, self._heads):
            self._head_bytes += len(data)
        if self._head_bytes > HEAD_MAX_BYTES:
            self._in_head = False
            self.transport.write(_REFUSAL)
            self.transport.close()
