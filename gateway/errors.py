"""How the gateway answers what went wrong: invalid input (422, never echoing it) and
Redis failing (503 to retry, or 500), logged without a message's text."""

from __future__ import annotations

import json
import logging
import time

from fastapi import Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from redis.exceptions import BusyLoadingError, OutOfMemoryError, ReadOnlyError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from bus_redis.codec import safe

log = logging.getLogger("gateway.app")


async def invalid(_request: Request, exc: Exception) -> Response:
    """422 with what failed where (``type``, ``loc``, ``msg``), never what was sent: a
    message's text stays out of answers and logs. ASCII-escaped: a lone surrogate (valid
    JSON, not UTF-8) in a value or a key cannot fail the answer (FastAPI's own handler
    then raised, and the traceback logged the text)."""
    assert isinstance(exc, RequestValidationError)
    detail = [{k: e.get(k) for k in ("type", "loc", "msg")} for e in exc.errors()]
    body = json.dumps({"detail": jsonable_encoder(detail)}, ensure_ascii=True)
    return Response(body, 422, media_type="application/json")


async def redis_failed(_request: Request, exc: Exception) -> Response:
    """Redis unreachable, loading, timing out, out of memory or read-only: 503 with
    ``Retry-After`` (the page and well-behaved clients try again); Redis refusing a
    command otherwise (a key of another type at a user's key, written by a client with the
    channel's ACL): 500. Logged at most once a ``LOG_EVERY_S`` per kind, with Redis'
    own words only: redis-py puts a failed pipeline's command, arguments included (a
    message's text), in its error message."""
    transient = isinstance(
        exc,
        (
            RedisConnectionError,
            RedisTimeoutError,
            BusyLoadingError,
            OutOfMemoryError,
            ReadOnlyError,
        ),
    )
    _log_redis_failure(exc, transient)
    if transient:
        detail = {"detail": "the message store is unavailable; try again"}
        return JSONResponse(detail, 503, headers={"Retry-After": "1"})
    return JSONResponse({"detail": "the message store refused the request"}, 500)


LOG_EVERY_S = 10.0
_logged: dict[str, float] = {}


def _log_redis_failure(exc: Exception, transient: bool) -> None:
    kind = type(exc).__name__
    now = time.monotonic()
    if now - _logged.get(kind, float("-inf")) < LOG_EVERY_S:
        return
    _logged[kind] = now
    words = str(exc).rpartition("caused error: ")[2][:120]  # not the pipeline's command
    log.log(logging.WARNING if transient else logging.ERROR, "Redis: %s: %s", kind, safe(words))
