"""Counters and histograms for the turn path that take no lock.

``prometheus_client``'s own take a ``threading.Lock`` per increment (~1 µs, several a
turn). A worker's metrics have one writer, its event loop, and are read by a scrape
served by that same loop (``worker.ops.health``): plain numbers are enough. They are
collected into the same registry and render as ``prometheus_client``'s would (``_total``
for counters, cumulative ``_bucket`` / ``_sum`` / ``_count`` for histograms), without the
``_created`` samples. A wrong number of label values or a negative increment raises
``ValueError`` as there.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString


class Count:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self.value += amount


class Spread:
    """One histogram's buckets: ``counts[i]`` are the values in ``(bounds[i-1], bounds[i]]``,
    the last one those above every bound."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value


class Counter:
    """A counter family: ``inc()`` without labels, ``labels(v)`` for a child."""

    def __init__(
        self, name: str, doc: str, labels: Sequence[str] = (), *, registry: CollectorRegistry
    ) -> None:
        self.name, self.doc, self.label_names = name, doc, list(labels)
        self._children: dict[tuple[str, ...], Count] = {}
        self._plain = None if labels else self._child(())
        registry.register(self)

    def _child(self, values: tuple[str, ...]) -> Count:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = Count()
        return child

    def labels(self, *values: str) -> Count:
        if len(values) != len(self.label_names) or not values:
            raise ValueError(f"{self.name} takes label values for {self.label_names}")
        return self._child(tuple(str(v) for v in values))

    def inc(self, amount: float = 1.0) -> None:
        if self._plain is None:
            raise ValueError(f"{self.name} is counted through labels()")
        self._plain.inc(amount)

    def describe(self) -> Iterator[Metric]:
        yield CounterMetricFamily(self.name, self.doc, labels=self.label_names)

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.doc, labels=self.label_names)
        for values, child in list(self._children.items()):
            family.add_metric(list(values), child.value)
        yield family


class Histogram:
    """A histogram without labels."""

    def __init__(
        self, name: str, doc: str, *, buckets: Sequence[float], registry: CollectorRegistry
    ) -> None:
        self.name, self.doc = name, doc
        self._spread = Spread(sorted(float(b) for b in buckets if b != float("inf")))
        self.observe = self._spread.observe
        registry.register(self)

    def describe(self) -> Iterator[Metric]:
        yield HistogramMetricFamily(self.name, self.doc)

    def collect(self) -> Iterator[Metric]:
        spread = self._spread
        counts, total = list(spread.counts), spread.sum
        cumulative, buckets = 0, []
        for bound, n in zip((*spread.bounds, float("inf")), counts, strict=True):
            cumulative += n
            buckets.append((floatToGoString(bound), cumulative))  # type: ignore[no-untyped-call]
        family = HistogramMetricFamily(self.name, self.doc)
        family.add_metric([], buckets, sum_value=total)
        yield family
