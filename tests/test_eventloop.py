"""The worker's event loop coalesces wake-ups (worker/runtime/eventloop.py): after a
wake-up with one ready socket it lingers, and what became ready meanwhile is handled in
the same pass. Asserted on behaviour (what one ``select`` returns), never on time: the
linger's sleep is injected, and "meanwhile" is what that sleep does."""

from __future__ import annotations

import asyncio
import selectors
import socket
from collections.abc import Iterator

import pytest

from worker.runtime.eventloop import LingeringSelector, loop_factory


@pytest.fixture
def pairs() -> Iterator[list[tuple[socket.socket, socket.socket]]]:
    made = [socket.socketpair() for _ in range(2)]
    yield made
    for a, b in made:
        a.close()
        b.close()


def _selector(
    pairs: list[tuple[socket.socket, socket.socket]], meanwhile: list[bytes | None]
) -> tuple[LingeringSelector, list[float]]:
    """A selector over both pairs' read ends; its linger writes ``meanwhile`` to them."""
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        for (_, writer), data in zip(pairs, meanwhile, strict=True):
            if data is not None:
                writer.send(data)

    sel = LingeringSelector(0.0005, sleep=sleep)
    for reader, _ in pairs:
        sel.register(reader, selectors.EVENT_READ)
    return sel, slept


def test_a_lone_wake_up_lingers_and_takes_what_arrived_meanwhile(pairs: list) -> None:
    sel, slept = _selector(pairs, meanwhile=[b"more", b"other"])
    pairs[0][1].send(b"first")
    ready = sel.select(timeout=5)
    assert slept == [0.0005]
    assert sorted((key.fd, mask) for key, mask in ready) == sorted(
        (r.fileno(), selectors.EVENT_READ) for r, _ in pairs
    )  # each socket once
    assert pairs[0][0].recv(100) == b"firstmore"  # one read takes both replies
    sel.close()


def test_no_linger_when_the_loop_is_busy_or_several_sockets_woke_it(pairs: list) -> None:
    sel, slept = _selector(pairs, meanwhile=[None, None])
    pairs[0][1].send(b"x")
    assert len(sel.select(timeout=0)) == 1  # the loop has callbacks waiting: no linger
    pairs[1][1].send(b"y")
    assert len(sel.select(timeout=5)) == 2  # several ready: the pass already batches
    assert slept == []
    sel.close()


def test_nothing_ready_no_linger(pairs: list) -> None:
    sel, slept = _selector(pairs, meanwhile=[b"late", None])
    assert sel.select(timeout=0.001) == []  # a timer's wake-up: nothing to coalesce
    assert slept == []
    sel.close()


def test_one_socket_ready_both_ways_is_one_entry_with_both_events(pairs: list) -> None:
    """The socket that woke the loop is ready again after the linger (epoll is level
    triggered): its events are merged into its one entry, never listed twice."""
    slept: list[float] = []
    sel = LingeringSelector(0.0005, sleep=slept.append)
    reader, writer = pairs[0]
    sel.register(reader, selectors.EVENT_READ | selectors.EVENT_WRITE)
    writer.send(b"x")
    ready = sel.select(timeout=5)
    assert slept == [0.0005]
    assert [(k.fd, m) for k, m in ready] == [
        (reader.fileno(), selectors.EVENT_READ | selectors.EVENT_WRITE)
    ]
    sel.close()


def test_the_linger_never_runs_past_the_timeout(pairs: list) -> None:
    sel, slept = _selector(pairs, meanwhile=[None, None])
    pairs[0][1].send(b"x")
    assert len(sel.select(timeout=0.0001)) == 1  # a timer is due in 100 µs
    assert len(slept) <= 1
    assert all(0 < s <= 0.0001 for s in slept)
    sel.close()


def test_linger_zero_is_asyncios_own_loop() -> None:
    assert loop_factory(0) is None
    factory = loop_factory(500)
    assert factory is not None
    loop = factory()
    try:
        assert isinstance(loop, asyncio.SelectorEventLoop)
        assert isinstance(loop._selector, LingeringSelector)  # type: ignore[attr-defined]
        assert loop._selector.linger_s == pytest.approx(0.0005)  # type: ignore[attr-defined]
        assert loop.run_until_complete(asyncio.sleep(0, result=42)) == 42
    finally:
        loop.close()


async def _echo_round_trips(n: int) -> list[bytes]:
    """Round trips over a real local TCP server (what a worker's Redis connection does)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(100):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    got = []
    for i in range(n):
        writer.write(b"%d;" % i)
        got.append(await reader.readexactly(len(b"%d;" % i)))
    writer.close()
    await writer.wait_closed()
    server.close()
    await server.wait_closed()
    return got


def test_a_lingering_loop_runs_a_real_connection_to_the_end() -> None:
    with asyncio.Runner(loop_factory=loop_factory(500)) as runner:
        assert runner.run(_echo_round_trips(50)) == [b"%d;" % i for i in range(50)]


def test_only_the_run_command_lingers_and_the_setting_is_checked() -> None:
    from pydantic import ValidationError

    from worker.cli.main import build_parser
    from worker.settings import Settings

    parser = build_parser()
    assert parser.parse_args(["run"]).linger is True
    assert getattr(parser.parse_args(["status"]), "linger", False) is False
    assert Settings().loop_linger_us == 500
    assert Settings(loop_linger_us=0).loop_linger_us == 0
    with pytest.raises(ValidationError):
        Settings(loop_linger_us=-1)


def test_the_worker_lets_the_young_generation_grow_and_freezes_what_it_built() -> None:
    import gc

    from pydantic import ValidationError

    from worker.runtime import collector
    from worker.settings import Settings

    before = gc.get_threshold()
    try:
        collector.tune(0)  # off: Python's own settings
        assert gc.get_threshold() == before
        assert gc.get_freeze_count() == 0
        collector.tune(10_000)
        assert gc.get_threshold() == (10_000, *before[1:])
        assert gc.get_freeze_count() > 0  # what exists now is never walked again
        assert Settings().gc_young_threshold == 10_000
        with pytest.raises(ValidationError):
            Settings(gc_young_threshold=-1)
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
