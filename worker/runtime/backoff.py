"""Exponential backoff for the reconnect loops (queue reads, the control subscription)."""

from __future__ import annotations

import asyncio
import logging


class Backoff:
    def __init__(
        self, what: str, logger: logging.Logger, *, first_s: float = 0.05, cap_s: float = 2.0
    ) -> None:
        self.what = what
        self.log = logger
        self.first_s = first_s
        self.cap_s = cap_s
        self.delay_s = first_s

    def reset(self) -> None:
        self.delay_s = self.first_s

    async def after(self, exc: BaseException) -> None:
        """Log the failure, wait, and double the next wait (up to the cap)."""
        self.log.warning(
            "%s failed (%s); retrying in %.2fs", self.what, type(exc).__name__, self.delay_s
        )
        await asyncio.sleep(self.delay_s)
        self.delay_s = min(self.delay_s * 2, self.cap_s)
