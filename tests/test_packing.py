"""hiredis packing (worker/runtime/packing.py) writes the bytes redis-py would, and leaves what it
does not take to redis-py, on a real redis-server and on the protocol level."""

from __future__ import annotations

import pytest
from redis.asyncio.connection import Connection
from redis.exceptions import DataError

from worker.runtime.packing import _fast


def _both(*args: object) -> tuple[bytes, bytes]:
    fast, plain = _fast(Connection)(), Connection()
    return b"".join(fast.pack_command(*args)), b"".join(plain.pack_command(*args))


@pytest.mark.parametrize(
    "args",
    [
        ("EVALSHA", "a" * 40, 2, "k1", "k2", "é ü", b"\xff\xfe", 12345678901234567890, -1),
        ("CONFIG GET", "maxmemory-policy"),
        ("SET", "k", 1.5),  # floats: redis-py's repr
        ("XADD", "s", "*", "payload", "x" * 100_000),
    ],
)
def test_the_same_bytes_as_redis_py(args: tuple[object, ...]) -> None:
    fast, plain = _both(*args)
    assert fast == plain


@pytest.mark.parametrize("bad", [None, True, "\ud800"])
def test_what_hiredis_does_not_take_fails_as_redis_py_says(bad: object) -> None:
    with pytest.raises((DataError, UnicodeEncodeError)) as fast:
        _fast(Connection)().pack_command("SET", "k", bad)
    with pytest.raises((DataError, UnicodeEncodeError)) as plain:
        Connection().pack_command("SET", "k", bad)
    assert type(fast.value) is type(plain.value)


async def test_a_worker_client_round_trips(redis_server) -> None:  # type: ignore[no-untyped-def]
    from worker.app import make_redis

    redis = make_redis(redis_server.url)
    try:
        assert redis.connection_pool.connection_class.__name__.startswith("FastPacking")
        await redis.set("packing:k", "é" * 3)
        assert await redis.get("packing:k") == "é" * 3
        async with redis.pipeline(transaction=True) as pipe:
            pipe.incr("packing:n")
            pipe.incrby("packing:n", 41)
            assert await pipe.execute() == [1, 42]
        await redis.delete("packing:k", "packing:n")
    finally:
        await redis.aclose()
