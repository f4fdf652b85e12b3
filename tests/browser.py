"""The chat page in a real browser: Debian's chromium driven by Playwright (Python), from
the ``browser`` fixture (tests/conftest.py): what the page tests do with it.

Screenshots are kept in ``$TEST_ARTIFACTS`` (default ``test-artifacts/``) as test artifacts.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

from stacks import Stack

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(os.environ.get("TEST_ARTIFACTS", "test-artifacts"))
TIMEOUT_MS = 20_000


def signed_in(browser: Any, stack: Stack, token: str) -> Any:
    """A new browser context's page, signed in with ``token``, its chat list loaded."""
    assert stack.lb is not None
    context = browser.new_context()
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    page.goto(stack.lb.url)
    page.get_by_test_id("login").wait_for()
    page.fill("#token", token)
    page.click("#login button")
    page.wait_for_selector("body[data-ready]")  # the chat list is loaded
    return page


def say(page: Any, text: str) -> None:
    page.fill("#input", text)
    page.press("#input", "Enter")


def assistant(page: Any, text: str) -> Any:
    return page.locator(".msg.assistant", has_text=text)


def until_js(page: Any, expression: str) -> None:
    """Poll a JavaScript expression until it is true (``wait_for_function`` evaluates
    strings with ``eval``, which the page's Content-Security-Policy forbids)."""
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    while not page.evaluate(expression):
        assert time.monotonic() < deadline, f"still false: {expression}"
        page.wait_for_timeout(20)


def shot(page: Any, name: str) -> None:
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)
