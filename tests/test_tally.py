"""The worker's lock-free counters and histograms (``worker.ops.tally``) render the very
samples ``prometheus_client``'s own would for the same observations."""

from __future__ import annotations

import random

import prometheus_client as pc
import pytest
from prometheus_client import generate_latest

from worker.ops import tally

BUCKETS = (0.005, 0.01, 0.025, 0.25, 1, 300)
ON_BOUNDS = [0.0, 0.005, 0.01, 0.25, 1.0, 300.0]  # a value on a bound counts in its bucket


def _samples(registry: pc.CollectorRegistry, name: str) -> dict[str, float]:
    """A family's samples but ``_created``, by name and labels."""
    out = {}
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith(name) and "_created" not in line:
            sample, value = line.rsplit(" ", 1)
            out[sample] = float(value)
    return out


def _cases() -> list[list[float]]:
    rng = random.Random(15)
    cases: list[list[float]] = [[], ON_BOUNDS, [1000.0, 0.0]]
    for _ in range(60):
        cases.append(
            [
                rng.choice(ON_BOUNDS) if rng.random() < 0.3 else rng.uniform(0, 1000)
                for _ in range(rng.randint(1, 40))
            ]
        )
    return cases


@pytest.mark.parametrize("values", _cases())
def test_lock_free_metrics_render_as_prometheus_client_does(values: list[float]) -> None:
    ours, theirs = pc.CollectorRegistry(), pc.CollectorRegistry()
    h1 = tally.Histogram("t_seconds", "doc", buckets=BUCKETS, registry=ours)
    h2 = pc.Histogram("t_seconds", "doc", buckets=BUCKETS, registry=theirs)
    c1 = tally.Counter("t_turns", "doc", ["outcome"], registry=ours)
    c2 = pc.Counter("t_turns", "doc", ["outcome"], registry=theirs)
    p1 = tally.Counter("t_requests", "doc", registry=ours)
    p2 = pc.Counter("t_requests", "doc", registry=theirs)
    for v in values:
        h1.observe(v)
        h2.observe(v)
        outcome = "message" if v < 1 else "cancelled"
        c1.labels(outcome).inc()
        c2.labels(outcome).inc()
        p1.inc(v)
        p2.inc(v)
    for family in ("t_seconds", "t_turns", "t_requests"):
        mine, want = _samples(ours, family), _samples(theirs, family)
        assert mine.keys() == want.keys()
        for sample, value in want.items():
            assert mine[sample] == pytest.approx(value), sample


def test_misuse_raises_as_prometheus_client_does() -> None:
    registry = pc.CollectorRegistry()
    labelled = tally.Counter("t_turns", "doc", ["outcome"], registry=registry)
    plain = tally.Counter("t_plain", "doc", registry=registry)
    for wrong in ((), ("a", "b")):
        with pytest.raises(ValueError, match="takes label values"):
            labelled.labels(*wrong)
    with pytest.raises(ValueError, match="through labels"):
        labelled.inc()
    with pytest.raises(ValueError, match="takes label values"):
        plain.labels("x")
    with pytest.raises(ValueError, match="non-negative"):
        plain.inc(-1)
    with pytest.raises(ValueError, match="Duplicated timeseries"):  # as between their own
        pc.Counter("t_turns", "doc", registry=registry)
    big = tally.Histogram("t_big", "doc", buckets=(1e6,), registry=registry)
    big.observe(5)
    assert 't_big_bucket{le="1e+06"} 1.0' in generate_latest(registry).decode()
