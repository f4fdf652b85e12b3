"""Prometheus metrics of one worker process (``prometheus-client``), in a registry of its
own so that several in-process workers (tests, the demo) never share counters.

No label carries a session, user, chat or message id: labels are outcomes, error codes,
reasons and token kinds, all from small fixed sets. Counters and histograms are
``worker.ops.tally``'s (no lock an increment); gauges are ``prometheus_client``'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, generate_latest

from worker.ops.tally import Counter, Histogram

# turn latencies: a fast echo turn takes ~1 ms, a model turn seconds to minutes
_TURN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_FAST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
DEAD_REASONS = frozenset({"invalid_message", "too_large", "failed", "other"})


class WorkerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self._outcomes: dict[str, Any] = {}
        self.turns = Counter(
            "agent_turns", "Entries handled, by outcome (message or an error code)",
            ["outcome"], registry=r,
        )  # fmt: skip
        self.turn_seconds = Histogram(
            "agent_turn_seconds", "From taking an entry to its committed answer",
            buckets=_TURN_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue_wait_seconds = Histogram(
            "agent_queue_wait_seconds", "From publish (the entry's id) to the start of its turn",
            buckets=_TURN_BUCKETS, registry=r,
        )  # fmt: skip
        self.handling = 0  # entries being handled: read at scrape time, no lock a turn
        self.in_flight = Gauge("agent_turns_in_flight", "Entries being handled", registry=r)
        self.in_flight.set_function(lambda: self.handling)
        self.oldest_queued_seconds = Gauge(
            "agent_oldest_queued_seconds",
            "Age of the oldest unread notification over the served channels' ready queues",
            registry=r,
        )
        self.leases_lost = Counter("agent_leases_lost", "Leases lost while held", registry=r)
        self.fenced_writes_rejected = Counter(
            "agent_fenced_writes_rejected", "Writes refused because the lease was lost",
            registry=r,
        )  # fmt: skip
        self.redeliveries = Counter(
            "agent_redeliveries", "Entries taken again after a failed or lost attempt",
            registry=r,
        )  # fmt: skip
        self.dead_letters = Counter(
            "agent_dead_letters", "Entries dead-lettered, by reason", ["reason"], registry=r
        )
        self.provider_requests = Counter(
            "agent_provider_requests", "Model calls (each with its retries)", registry=r
        )
        self.provider_errors = Counter(
            "agent_provider_errors", "Model calls that failed after their retries", registry=r
        )
        self.provider_retries = Counter(
            "agent_provider_retries", "Model call attempts retried", registry=r
        )
        self.tokens = Counter(
            "agent_provider_tokens", "Tokens reported by the provider", ["kind"], registry=r
        )
        self._token_kinds = [
            (kind, self.tokens.labels(kind.removesuffix("_tokens")))
            for kind in ("prompt_tokens", "completion_tokens")
        ]
        self.interrupts_refused = Counter(
            "agent_interrupts_refused",
            "Interrupts not carried out (the message after the marker is not one the session takes)",
            registry=r,
        )  # fmt: skip
        self.cancel_seconds = Histogram(
            "agent_cancel_seconds", "From a control reaching the worker to its turn cancelled",
            buckets=_FAST_BUCKETS, registry=r,
        )  # fmt: skip

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))

    def turn(self, outcome: str, seconds: float) -> None:
        """A committed entry (its outcome's counter child is looked up once)."""
        child = self._outcomes.get(outcome)
        if child is None:
            child = self._outcomes[outcome] = self.turns.labels(outcome)
        child.value += 1
        self.turn_seconds.observe(seconds)

    def dead_letter(self, reason: str) -> None:
        self.dead_letters.labels(reason if reason in DEAD_REASONS else "other").inc()

    def usage(self, usage: dict[str, Any]) -> None:
        for kind, child in self._token_kinds:
            value = usage.get(kind)
            if isinstance(value, int) and value > 0:
                child.inc(value)


class MeteredProvider:
    """Counts a provider's calls, failures and tokens; everything else passes through."""

    def __init__(self, provider: Any, metrics: WorkerMetrics) -> None:
        self._provider = provider
        self._metrics = metrics
        if hasattr(provider, "on_retry"):
            provider.on_retry = metrics.provider_retries.inc

    def __getattr__(self, name: str) -> Any:
        return getattr(self._provider, name)

    async def chat_with_retry(self, **kwargs: Any) -> Any:
        self._metrics.provider_requests.inc()
        try:
            response = await self._provider.chat_with_retry(**kwargs)
        except Exception:
            self._metrics.provider_errors.inc()
            raise
        self._metrics.usage(getattr(response, "usage", None) or {})
        return response


def since(start: float) -> float:
    return time.monotonic() - start


Clock = Callable[[], float]
