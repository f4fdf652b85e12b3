"""The turn path's multiplexed connection (bus_redis.mux) against a real redis-server:
replies reach their callers, in order, through cancellations, errors, restarts and AUTH."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import fakeredis
import pytest
import redis.asyncio as aioredis
from redis.asyncio.sentinel import Sentinel
from redis.backoff import ExponentialBackoff
from redis.exceptions import (
    AuthenticationError,
    ConnectionError,
    DataError,
    NoScriptError,
    ResponseError,
)
from redis.retry import Retry
from replies import wait_until_async
from servers import RedisServer

from bus_redis import RedisBus
from bus_redis.codec import text
from bus_redis.mux import Multiplexed

pytestmark = pytest.mark.real_redis

ECHO = "return ARGV[1]"
SLOW_ECHO = """
local t0 = redis.call('TIME')
repeat
  local t = redis.call('TIME')
until (t[1] - t0[1]) * 1000000 + (t[2] - t0[2]) > 20000
return ARGV[1]
"""


async def test_concurrent_callers_each_get_their_own_reply(real_redis: aioredis.Redis) -> None:
    mux = Multiplexed.for_client(real_redis)
    assert mux is not None
    try:
        replies = await asyncio.gather(
            *(mux.execute("EVAL", ECHO, 0, f"caller-{i}") for i in range(300))
        )
        assert replies == [f"caller-{i}".encode() for i in range(300)]
        assert mux.commands == 300
    finally:
        await mux.aclose()


async def test_a_cancelled_caller_leaves_the_others_in_step(real_redis: aioredis.Redis) -> None:
    mux = Multiplexed.for_client(real_redis)
    assert mux is not None
    try:
        await mux.execute("PING")  # connected: the calls below only queue their bytes
        slow = asyncio.create_task(mux.execute("EVAL", SLOW_ECHO, 0, "slow"))
        b = asyncio.create_task(mux.execute("EVAL", ECHO, 0, "b"))
        c = asyncio.create_task(mux.execute("EVAL", ECHO, 0, "c"))
        await asyncio.sleep(0)  # each task has queued its command and waits for the reply
        slow.cancel()
        assert await b == b"b"  # the slow reply came first and was dropped, not given to b
        assert await c == b"c"
        with pytest.raises(asyncio.CancelledError):
            await slow
        assert await mux.execute("EVAL", ECHO, 0, "d") == b"d"
    finally:
        await mux.aclose()


async def test_error_replies_are_redis_py_errors_and_keep_step(
    real_redis: aioredis.Redis,
) -> None:
    mux = Multiplexed.for_client(real_redis)
    assert mux is not None
    try:
        await real_redis.set("a-string", "x")
        calls = [
            mux.execute("EVALSHA", "0" * 40, 0),
            mux.execute("EVAL", "return redis.error_reply('MINE broke')", 0),
            mux.execute("LPUSH", "a-string", "y"),
            mux.execute("EVAL", ECHO, 0, "after"),
            mux.execute("EVAL", "return {1, redis.error_reply('INNER no')}", 0),
        ]
        results = await asyncio.gather(*calls, return_exceptions=True)
        assert isinstance(results[0], NoScriptError)
        assert isinstance(results[1], ResponseError)
        assert "broke" in str(results[1])
        assert isinstance(results[2], ResponseError)
        assert "WRONGTYPE" in str(results[2])
        assert results[3] == b"after"
        nested = results[4]
        assert isinstance(nested, list)
        assert nested[0] == 1
        assert isinstance(nested[1], ResponseError)  # inside a reply: a value, as redis-py
    finally:
        await mux.aclose()


async def test_it_reconnects_after_a_server_restart_with_the_clients_retry() -> None:
    server = RedisServer().start()
    try:
        retrying = Retry(ExponentialBackoff(cap=0.2, base=0.01), retries=8)
        client = aioredis.from_url(server.url, retry=retrying, retry_on_error=[ConnectionError])
        once = aioredis.from_url(server.url)  # redis-py's default: no retry
        mux, bare = Multiplexed.for_client(client), Multiplexed.for_client(once)
        assert mux is not None
        assert bare is not None
        assert await mux.execute("SET", "k", "before") == b"OK"
        assert await bare.execute("PING") == b"PONG"
        server.stop(kill=True)
        with pytest.raises(ConnectionError):  # no retry: the caller gets redis-py's error
            await bare.execute("PING")
        server.start()  # same port, empty database
        assert await mux.execute("SET", "k", "after") == b"OK"  # a lost link, then a new one
        assert await client.get("k") == b"after"
        assert await bare.execute("PING") == b"PONG"  # the next call connects again
        await mux.aclose()
        await bare.aclose()
        await client.aclose()
        await once.aclose()
    finally:
        server.cleanup()


async def test_auth_user_and_database_come_from_the_url() -> None:
    server = RedisServer(extra=["--requirepass", "s3cret"]).start()
    try:
        admin = aioredis.from_url(f"redis://:s3cret@127.0.0.1:{server.port}/3")
        await admin.execute_command("ACL", "SETUSER", "bot", "on", ">pw", "~*", "+@all")
        as_user = aioredis.from_url(f"redis://bot:pw@127.0.0.1:{server.port}/3")
        wrong = aioredis.from_url(f"redis://bot:nope@127.0.0.1:{server.port}/3")
        for client, value in ((admin, "by-default-user"), (as_user, "by-bot")):
            mux = Multiplexed.for_client(client)
            assert mux is not None
            assert await mux.execute("SET", value, "1") == b"OK"
            assert await mux.execute("ACL", "WHOAMI") == (
                b"bot" if client is as_user else b"default"
            )
            await mux.aclose()
        assert sorted(await admin.keys("*")) == [b"by-bot", b"by-default-user"]  # db 3
        bad = Multiplexed.for_client(wrong)
        assert bad is not None
        with pytest.raises(AuthenticationError):
            await bad.execute("PING")
        for c in (admin, as_user, wrong):
            await c.aclose()
    finally:
        server.cleanup()


def test_one_multiplexer_serves_successive_event_loops(redis_server: RedisServer) -> None:
    client = aioredis.from_url(redis_server.url)
    mux = Multiplexed.for_client(client)
    assert mux is not None
    assert asyncio.run(mux.execute("EVAL", ECHO, 0, "first loop")) == b"first loop"

    assert asyncio.run(mux.execute("EVAL", ECHO, 0, "second loop")) == b"second loop"

    async def clients() -> int:
        async with aioredis.from_url(redis_server.url) as admin:
            return len(await admin.client_list())

    async def back_to(count: int) -> bool:  # the server sees the old socket's close
        async def equal() -> bool:
            return await clients() == count

        return await wait_until_async(equal, timeout_s=5)

    before = asyncio.run(clients())
    asyncio.run(mux.execute("PING"))  # a third loop: the second loop's link is closed
    assert asyncio.run(back_to(before))
    asyncio.run(mux.aclose())  # from yet another loop: no "event loop is closed"


def test_clients_it_cannot_reproduce_keep_redis_py() -> None:
    assert Multiplexed.for_client(fakeredis.FakeAsyncRedis()) is None
    assert Multiplexed.for_client(aioredis.from_url("rediss://127.0.0.1:1/0")) is None
    assert Multiplexed.for_client(aioredis.from_url("redis://127.0.0.1:1/0", protocol=3)) is None
    timed = aioredis.from_url("redis://127.0.0.1:1/0", socket_timeout=5)
    assert Multiplexed.for_client(timed) is None
    unix = Multiplexed.for_client(aioredis.from_url("unix:///tmp/redis.sock?db=2"))
    assert unix is not None
    assert unix.path == "/tmp/redis.sock"
    assert unix.db == 2
    assert RedisBus(fakeredis.FakeAsyncRedis()).fast is None  # fakeredis: redis-py's path


async def test_the_bus_sends_its_scripts_over_it(real_redis: aioredis.Redis) -> None:
    bus = RedisBus(real_redis)
    assert bus.fast is not None
    await bus.scripts.load_all()
    acquired = await bus.acquire("t:one", "w1")
    assert bus.fast.commands == 1
    await bus.release("t:one", acquired.token)  # type: ignore[union-attr]
    assert await bus.peek("t:one", after="0", count=5) == []
    assert bus.fast.commands == 3
    await bus.aclose()


async def test_a_script_the_server_forgot_is_sent_whole_over_it(
    real_redis: aioredis.Redis,
) -> None:
    """The first script call connects (no link yet); after ``SCRIPT FLUSH`` a call is
    answered ``NOSCRIPT`` and sent again whole (``EVAL``), both over the one connection,
    while concurrent calls keep their own replies."""
    bus = RedisBus(real_redis)
    assert bus.fast is not None
    await real_redis.script_flush()
    calls = [bus.acquire(f"t:forgot{i}", "w1", select=False) for i in range(5)]
    acquired = await asyncio.gather(*calls)
    assert all(a.token.endswith("|w1") for a in acquired)  # type: ignore[union-attr]
    assert bus.fast.commands == 10  # each: EVALSHA refused, then EVAL
    await real_redis.script_flush()
    released = await asyncio.gather(
        *(bus.release(f"t:forgot{i}", a.token) for i, a in enumerate(acquired))  # type: ignore[union-attr]
    )
    assert released == [True] * 5
    assert await real_redis.exists(*(bus.keys.lease(f"t:forgot{i}") for i in range(5))) == 0
    await bus.scripts.load_all()  # (the server is the session's: later tests find them)
    await bus.aclose()


async def test_a_caller_cancelled_while_connecting_cancels_only_itself(
    real_redis: aioredis.Redis,
) -> None:
    mux = Multiplexed.for_client(real_redis)
    assert mux is not None
    try:
        calls = [asyncio.create_task(mux.execute("EVAL", ECHO, 0, f"c{i}")) for i in range(4)]
        await asyncio.sleep(0)  # the first has started the connection; the others wait on it
        calls[0].cancel()
        replies = await asyncio.gather(*calls[1:])
        assert replies == [b"c1", b"c2", b"c3"]
        assert calls[0].cancelled()
    finally:
        await mux.aclose()


async def test_aclose_while_connecting_keeps_no_connection(real_redis: aioredis.Redis) -> None:
    mux = Multiplexed.for_client(real_redis)
    assert mux is not None
    call = asyncio.create_task(mux.execute("PING"))
    await asyncio.sleep(0)  # connecting
    await mux.aclose()
    later = asyncio.create_task(mux.execute("PING"))  # while the first connect still runs
    with pytest.raises(ConnectionError):
        await call
    assert await later == b"PONG"  # a later call connects again
    await mux.aclose()
    assert mux._link is None


async def test_a_command_cancelled_before_it_left_is_not_sent(real_redis: aioredis.Redis) -> None:
    mux = Multiplexed.for_client(real_redis)
    assert mux is not None
    try:
        await mux.execute("PING")
        incr = asyncio.create_task(mux.execute("INCR", "sent-or-not"))
        await asyncio.sleep(0)  # queued for this iteration's write
        incr.cancel()
        assert await mux.execute("GET", "sent-or-not") is None
    finally:
        await mux.aclose()


async def test_values_it_cannot_send_fail_as_with_redis_py(real_redis: aioredis.Redis) -> None:
    mux = Multiplexed.for_client(real_redis)
    assert mux is not None
    with pytest.raises(DataError):
        await mux.execute("SET", "k", None)
    with pytest.raises(UnicodeEncodeError):  # redis-py's own error here (test_packing.py)
        await mux.execute("SET", "k", "\udcff")
    assert mux.commands == 0


def test_the_retry_policy_is_what_redis_py_would_apply() -> None:
    given = Retry(ExponentialBackoff(), retries=5)
    plain = Multiplexed.for_client(aioredis.from_url("redis://127.0.0.1:1/0", retry=given))
    assert plain is not None
    assert plain.retry._retries == 0  # redis-py retries nothing without retry_on_error
    on_error = Multiplexed.for_client(
        aioredis.from_url("redis://127.0.0.1:1/0", retry=given, retry_on_error=[ConnectionError])
    )
    assert on_error is not None
    assert on_error.retry._retries == 5
    assert Multiplexed.for_client(Sentinel([("127.0.0.1", 1)]).master_for("main")) is None


async def test_a_vanished_peer_is_detected_by_the_socket(real_redis: aioredis.Redis) -> None:
    """No FIN from a partitioned Redis: keepalive and a user timeout end the link (and fail
    its waiting commands) instead of TCP's ~15-minute retransmission."""
    mux = Multiplexed.for_client(real_redis)
    assert mux is not None
    try:
        await mux.execute("PING")
        assert mux._link is not None
        assert mux._link.transport is not None
        sock = mux._link.transport.get_extra_info("socket")
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 30_000
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 10
    finally:
        await mux.aclose()


async def test_notifications_are_read_on_a_connection_of_their_own(
    real_redis: aioredis.Redis,
) -> None:
    """The blocking read of the ready queues does not hold up the turn path's commands;
    a read cancelled while blocked (a stop) closes its connection, so the server hands
    the consumer nothing after it left: the next notification goes to another consumer."""
    bus = RedisBus(real_redis)
    ready = bus.keys.ready("web")
    await bus.ensure_groups([ready])
    await real_redis.xadd(ready, {"session": "web:a"})
    notes = await bus.read_notifications("w1", [ready], count=10, block_ms=1000)
    assert [n.session_key for n in notes] == ["web:a"]

    blocked = asyncio.create_task(bus.read_notifications("w1", [ready], count=10, block_ms=20_000))

    async def reader_blocked() -> bool:
        clients = await real_redis.client_list()
        return any(c["cmd"] == "xreadgroup" and c["flags"] == "b" for c in clients)

    assert await wait_until_async(reader_blocked, timeout_s=10)
    assert await bus.peek("web:a", after="0", count=1) == []  # the turn path is not held up
    blocked.cancel()
    with pytest.raises(asyncio.CancelledError):
        await blocked

    async def reader_gone() -> bool:
        return not await reader_blocked()

    assert await wait_until_async(reader_gone, timeout_s=10)
    await real_redis.xadd(ready, {"session": "web:b"})
    other = await bus.read_notifications("w2", [ready], count=10, block_ms=1000)
    assert [n.session_key for n in other] == ["web:b"]
    pending = await real_redis.xpending_range(ready, "workers", "-", "+", 10, consumername="w1")
    assert [text(p["message_id"]) for p in pending] == [notes[0].entry_id]
    await bus.aclose()


@pytest.fixture
async def mux(real_redis: aioredis.Redis) -> AsyncIterator[Multiplexed]:
    made = Multiplexed.for_client(real_redis)
    assert made is not None
    yield made
    await made.aclose()


async def test_a_transaction_is_one_unit_among_concurrent_callers(
    real_redis: aioredis.Redis, mux: Multiplexed
) -> None:
    """MULTI ... EXEC leaves as one unit: other callers' commands, issued in the same
    iterations, never land inside it, and every caller gets its own replies."""

    async def block(i: int) -> list[object]:
        return await mux.transaction(("SET", f"t{i}", i), ("INCR", f"t{i}"), ("GET", f"t{i}"))

    got = await asyncio.gather(
        *(block(i) for i in range(200)),
        *(mux.execute("EVAL", ECHO, 0, f"caller-{i}") for i in range(200)),
    )
    assert got[:200] == [[b"OK", i + 1, str(i + 1).encode()] for i in range(200)]
    assert [text(r) for r in got[200:]] == [f"caller-{i}" for i in range(200)]


async def test_a_failed_transaction_raises_as_redis_py_and_keeps_step(
    real_redis: aioredis.Redis, mux: Multiplexed
) -> None:
    await real_redis.set("plain", "x")
    with pytest.raises(ResponseError, match="WRONGTYPE"):  # a runtime error: the rest ran
        await mux.transaction(("SET", "before", 1), ("XADD", "plain", "*", "f", "v"))
    assert await real_redis.get("before") == "1"
    with pytest.raises(ResponseError, match="wrong number of arguments"):  # refused: none ran
        await mux.transaction(("SET", "refused", 1), ("GET",))
    assert await real_redis.get("refused") is None
    with pytest.raises(ResponseError, match="EXEC without MULTI"):
        await mux.execute("EXEC")  # no MULTI was left open on the connection


async def test_a_transaction_cancelled_before_it_left_sends_nothing(
    real_redis: aioredis.Redis, mux: Multiplexed
) -> None:
    await mux.execute("PING")
    block = asyncio.create_task(mux.transaction(("INCR", "unit"), ("INCR", "unit")))
    await asyncio.sleep(0)  # queued for this iteration's write
    block.cancel()
    assert await mux.execute("GET", "unit") is None  # not half a block: none of it
    assert await mux.execute("INCR", "after") == 1  # and not inside an open MULTI


async def test_the_frontend_publishes_over_its_own_multiplexed_connection(
    real_redis: aioredis.Redis,
) -> None:
    from bus_redis import FrontendClient, InboundMessage, Keys

    client = FrontendClient(real_redis)
    try:
        ids = await asyncio.gather(
            *(
                client.send(
                    InboundMessage(channel="web", sender_id="u", chat_id=f"m{i}", content="x")
                )
                for i in range(50)
            )
        )
        assert client._mux is not None
        assert client._mux.commands == 50 * 5  # MULTI, three commands, EXEC each
        keys = Keys()
        for i, entry_id in enumerate(ids):
            stored = await real_redis.xrange(keys.inbound(f"web:m{i}"))
            assert [e for e, _ in stored] == [entry_id]
        assert await real_redis.zcard(keys.queued("web")) == 50
        assert await real_redis.xlen(keys.ready("web")) == 50
    finally:
        await client.aclose()


async def test_a_command_sent_now_leaves_at_once_after_what_waited_before_it() -> None:
    """``now``: written in the caller's own step (a stopped turn's commit does not wait
    for the end of a busy loop's iteration), after the commands queued before it, in
    order; the batch's scheduled write then finds nothing left."""
    from bus_redis.link import _Link

    class Transport:
        def __init__(self) -> None:
            self.writes: list[bytes] = []

        def write(self, data: bytes) -> None:
            self.writes.append(data)

    loop = asyncio.get_running_loop()
    link, transport = _Link(loop), Transport()
    link.connection_made(transport)  # type: ignore[arg-type]
    calls = [link.call(b"first;")]
    assert transport.writes == []  # with this iteration's batch
    calls.append(link.call(b"urgent;", now=True))
    assert transport.writes == [b"first;urgent;"]
    calls.append(link.call(b"later;"))
    await asyncio.sleep(0)  # the iteration ends: its batch is written
    assert transport.writes == [b"first;urgent;", b"later;"]
    link.data_received(b"+A\r\n+B\r\n+C\r\n")  # replies resolve callers in the order sent
    assert [call.result() for call in calls] == [b"A", b"B", b"C"]
