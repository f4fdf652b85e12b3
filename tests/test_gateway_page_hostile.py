"""The chat page in a real browser (Debian's chromium driven by Playwright) as a hostile
reviewer attacked it: a double click, a message too long, another user signing in after a
401, a chat opened while its answer ends, a gap reload racing a switch, a long chat
streaming, a full sessionStorage, a send failing after a switch, an IME's Enter, and the
gateway's own pages loading outside script. Each test failed on the page before its fix.

Same deployment as tests/test_gateway_page.py: two gateway replicas behind the failover
load balancer, two worker processes (started as processes: no worker code is imported
here) and the fake LLM. Screenshots go to ``$TEST_ARTIFACTS`` (default test-artifacts/).
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from browser import TIMEOUT_MS
from browser import assistant as _assistant
from browser import say as _say
from browser import shot as _shot
from browser import signed_in as _page
from browser import until_js as _until
from stacks import ALICE, ALICE_TOKEN, BOB_TOKEN, Stack, running_stack

pytestmark = [pytest.mark.real_redis, pytest.mark.slow, pytest.mark.frontend]


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with running_stack(gateways=2, workers=2, failover_lb=True) as st:
        yield st


def _api(stack: Stack) -> httpx.Client:
    assert stack.lb is not None
    return httpx.Client(base_url=stack.lb.url, headers=ALICE, timeout=30)


def _polled(check: Any, what: str) -> Any:
    """Poll ``check()`` (an HTTP read of the gateway) until it answers something true."""
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.05)  # polled: the workers answer on their own time
    raise AssertionError(f"never: {what}")


# --------------------------------------------------------------------------------------
def test_a_double_click_on_send_does_not_stop_the_message_it_sent(
    browser: Any, stack: Stack
) -> None:
    """The button turns into Stop under the pointer as soon as the first click has sent:
    the second click of a double click (or Enter then a click) posts /stop and cancels the
    turn that was just sent."""
    page = _page(browser, stack, ALICE_TOKEN)
    page.click("#new")
    stops: list[str] = []
    page.on("request", lambda r: stops.append(r.url) if r.url.endswith("/stop") else None)
    stack.llm.rearm()
    page.fill("#input", "block then answer me")
    page.dblclick("#send")
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    while not (stack.llm.started.is_set() or page.locator(".msg.error").count()):
        assert time.monotonic() < deadline, "neither answered nor refused"
        page.wait_for_timeout(20)  # the model is asked, or the turn ended before it was
    stack.llm.release()
    outcome = page.locator(".msg.error").or_(_assistant(page, "re: block then answer me"))
    outcome.first.wait_for()
    _shot(page, "review-double-click")
    assert stops == []
    assert page.locator(".msg.error", has_text="Stopped.").count() == 0
    page.context.close()


def test_a_too_long_message_is_said_to_be_too_long(browser: Any, stack: Stack) -> None:
    """The gateway's 422 carries a list of errors as ``detail``; the page prints it as
    ``[object Object]`` and offers a Retry that can never succeed."""
    page = _page(browser, stack, ALICE_TOKEN)
    page.click("#new")
    page.fill("#input", "x" * 100_001)
    page.press("#input", "Enter")
    error = page.locator(".msg.error").first
    error.wait_for()
    _shot(page, "review-too-long")
    assert "[object Object]" not in error.inner_text()
    assert "too" in error.inner_text().lower()
    page.context.close()


def test_signing_in_as_another_user_shows_nothing_of_the_first(browser: Any, stack: Stack) -> None:
    """A 401 (the token revoked or expired) brings back the sign-in form; whoever signs
    in next in that tab sees the previous user's conversation, which stays in the page,
    and goes on receiving her answers: her chat's event stream is never closed."""
    page = _page(browser, stack, ALICE_TOKEN)
    page.click("#new")
    _say(page, "alice private words")
    _assistant(page, "re: alice private words").wait_for()
    sid = page.evaluate("localStorage.getItem('agent-current')")
    page.route("**/api/**", lambda route: route.fulfill(status=401, json={"detail": "no"}))
    _say(page, "now refused")
    page.get_by_test_id("login").wait_for(state="visible")
    page.unroute("**/api/**")
    page.fill("#token", BOB_TOKEN)
    page.click("#login button")
    page.wait_for_selector("#log", state="visible")
    _until(page, "document.querySelectorAll('[data-testid=session]').length === 0")
    with _api(stack) as api:  # alice, on another device, goes on in her chat
        r = api.post(f"/api/sessions/{sid}/messages?wait=20", json={"content": "alice later"})
        assert r.status_code == 200, r.text
    _say(page, "bob speaking")  # a whole turn of bob's: alice's answer had all that time
    _assistant(page, "re: bob speaking").or_(page.locator(".msg.error").last).wait_for()
    _shot(page, "review-other-user-after-401")
    assert page.locator("#log", has_text="alice private words").count() == 0
    assert page.locator("#log", has_text="re: alice later").count() == 0
    page.context.close()


def test_an_answer_finished_while_a_chat_opens_is_shown_once(browser: Any, stack: Stack) -> None:
    """Opening a chat reads its cursor, then its history: a turn that ends between the two
    is in the history and is streamed again after the cursor, so it is shown twice."""
    with _api(stack) as api:
        chat = api.post("/api/sessions", json={}).json()
        sid = chat["id"]
        stack.llm.rearm()
        api.post(f"/api/sessions/{sid}/messages", json={"content": "block while opening"})
        assert stack.llm.started.wait(20)
        page = _page(browser, stack, ALICE_TOKEN)  # another device: no snapshot
        held: list[Any] = []
        page.route(f"**/api/sessions/{sid}/messages", lambda route: held.append(route))
        page.locator(f"li[data-id='{sid}'] button.open").click()
        deadline = time.monotonic() + TIMEOUT_MS / 1000
        while not held:
            assert time.monotonic() < deadline, "the history was never asked for"
            page.wait_for_timeout(20)
        stack.llm.release()

        def finished() -> str | None:
            status = api.get(f"/api/sessions/{sid}").json()
            rows = api.get(f"/api/sessions/{sid}/messages").json()
            done = status["state"] == "idle" and any(r["role"] == "assistant" for r in rows)
            return status["last_event_id"] if done else None

        last = _polled(finished, "the turn ended")
        held[0].continue_()
        page.unroute(f"**/api/sessions/{sid}/messages")
        page.wait_for_selector("#badge.connected")
        _until(
            page, f"JSON.parse(sessionStorage.getItem('chat-snapshot:{sid}')).cursor === '{last}'"
        )
        _shot(page, "review-opened-while-finishing")
        assert _assistant(page, "re: block while opening").count() == 1
        page.context.close()


def test_a_gap_reload_never_lands_in_the_chat_opened_meanwhile(browser: Any, stack: Stack) -> None:
    """A gap reloads the history of the chat it came from; the user opens another chat
    before it is back: that history is shown, and saved, as the other chat's (and the
    other chat's stream is followed from the first one's cursor)."""
    with _api(stack) as api:
        sids = []
        for words in ("gap chat old", "gap chat new"):
            sid = api.post("/api/sessions", json={}).json()["id"]
            r = api.post(f"/api/sessions/{sid}/messages?wait=20", json={"content": words})
            assert r.status_code == 200, r.text
            sids.append(sid)
        old, new = sids
    page = _page(browser, stack, ALICE_TOKEN)
    page.locator(f"li[data-id='{new}'] button.open").click()
    _assistant(page, "re: gap chat new").wait_for()
    page.locator(f"li[data-id='{old}'] button.open").click()
    _assistant(page, "re: gap chat old").wait_for()
    # the newer chat's saved cursor is behind what is kept (AGENT_REPLY_MAXLEN trimmed it)
    page.evaluate(
        f"""() => {{ const k = 'chat-snapshot:{new}';
            const s = JSON.parse(sessionStorage.getItem(k)); s.cursor = '1-0';
            sessionStorage.setItem(k, JSON.stringify(s)); }}"""
    )
    held: list[Any] = []
    page.route(f"**/api/sessions/{new}/messages", lambda route: held.append(route))
    page.locator(f"li[data-id='{new}'] button.open").click()
    page.get_by_test_id("notice").wait_for(state="visible")  # the gap
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    while not held:
        assert time.monotonic() < deadline, "the history was never asked for"
        page.wait_for_timeout(20)
    page.locator(f"li[data-id='{old}'] button.open").click()  # the user moves on
    _until(page, f"localStorage.getItem('agent-current') === '{old}'")
    with page.expect_response(f"**/api/sessions/{new}/messages"):
        held[0].continue_()
    page.unroute(f"**/api/sessions/{new}/messages")
    _say(page, "after the gap")  # then a whole turn: the late history is long back
    _assistant(page, "re: after the gap").wait_for()
    _shot(page, "review-gap-other-chat")
    assert page.locator("#title").inner_text() == "gap chat old"
    assert page.locator("#log", has_text="gap chat new").count() == 0
    page.context.close()


def _plant_history(stack: Stack, sid: str, rows: int, chars: int) -> None:
    """A long-lived chat: ``rows`` stored messages of ``chars`` characters each, written
    where the workers keep a durable session's history (as they would have, over weeks)."""
    key = next(iter(stack.admin.scan_iter(match=f"*:session:*{sid}", count=1000)))
    for i in range(rows):
        role = "user" if i % 2 == 0 else "assistant"
        row = {"role": role, "content": f"row {i} " + "w" * chars}
        stack.admin.hset(key, f"m:{i}", json.dumps(row))
    stack.admin.hset(key, "count", rows)


def _chat_with_history(stack: Stack, rows: int, chars: int, words: str) -> str:
    with _api(stack) as api:
        sid = api.post("/api/sessions", json={"title": words}).json()["id"]
        r = api.post(f"/api/sessions/{sid}/messages?wait=20", json={"content": words})
        assert r.status_code == 200, r.text
    _plant_history(stack, sid, rows, chars)
    return sid


def test_a_streamed_answer_in_a_long_chat_does_not_freeze_the_page(
    browser: Any, stack: Stack
) -> None:
    """Each delta rebuilds every bubble of the chat and writes the whole chat to
    sessionStorage: in a chat of 200 stored messages (2 MB, what the gateway serves at
    most) every 4 characters of an answer block the page for a third of a second."""
    sid = _chat_with_history(stack, 200, 10_000, "long chat")
    page = _page(browser, stack, ALICE_TOKEN)
    page.locator(f"li[data-id='{sid}'] button.open").click()
    page.locator(".msg", has_text="row 199").wait_for()
    page.wait_for_selector("#badge.connected")
    page.evaluate(
        """() => { window.longTasks = [];
            new PerformanceObserver((l) => { for (const e of l.getEntries())
                window.longTasks.push(e.duration); }).observe({ type: "longtask" }); }"""
    )
    words = "a short answer of some hundred characters, streamed four at a time " * 2
    _say(page, words.strip())
    _assistant(page, "re: " + words.strip()).wait_for(timeout=120_000)
    blocked = page.evaluate("window.longTasks.reduce((a, b) => a + b, 0)")
    _shot(page, "review-long-chat")
    assert blocked < 2_000, f"the page was blocked {blocked:.0f} ms while one answer streamed"
    page.context.close()


def test_opening_long_chats_in_one_tab_does_not_break_sending(browser: Any, stack: Stack) -> None:
    """Every chat opened is kept whole in sessionStorage and never evicted: after a few
    long chats the quota is full, ``save()`` throws inside ``render()``, and a message is
    shown as sent (Send turns into Stop) but never posted, with no error."""
    sids = [_chat_with_history(stack, 200, 9_000, f"big chat {n}") for n in range(3)]
    page = _page(browser, stack, ALICE_TOKEN)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    for sid in sids:
        page.locator(f"li[data-id='{sid}'] button.open").click()
        _until(page, f"localStorage.getItem('agent-current') === '{sid}'")
        page.locator(".msg", has_text="row 199").wait_for()
    _say(page, "still able to send")
    outcome = page.locator(".msg.error").or_(_assistant(page, "re: still able to send"))
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    with contextlib.suppress(PlaywrightTimeout):
        outcome.first.wait_for()
    _shot(page, "review-quota")
    shown = _assistant(page, "re: still able to send").count()
    assert shown == 1, f"no answer and no error shown; the page threw {errors}"
    page.context.close()


def test_a_send_that_fails_after_switching_chats_stays_in_its_chat(
    browser: Any, stack: Stack
) -> None:
    """send() writes its outcome into whatever chat is current when the post returns:
    the 'Not sent' notice (and its Retry, which posts the text into that chat) lands in the
    chat the user moved to."""
    with _api(stack) as api:
        first = api.post("/api/sessions", json={"title": "switch first"}).json()["id"]
        second = api.post("/api/sessions", json={"title": "switch second"}).json()["id"]
    page = _page(browser, stack, ALICE_TOKEN)
    page.locator(f"li[data-id='{first}'] button.open").click()
    _until(page, f"localStorage.getItem('agent-current') === '{first}'")
    held: list[Any] = []
    page.route(f"**/api/sessions/{first}/messages", lambda route: held.append(route))
    page.wait_for_selector("#badge.connected")
    _say(page, "meant for the first chat")
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    while not [r for r in held if r.request.method == "POST"]:
        assert time.monotonic() < deadline, "the message was never posted"
        page.wait_for_timeout(20)
    page.locator(f"li[data-id='{second}'] button.open").click()
    _until(page, f"localStorage.getItem('agent-current') === '{second}'")
    post = next(r for r in held if r.request.method == "POST")
    with page.expect_response(f"**/api/sessions/{first}/messages"):
        post.fulfill(status=500, json={"detail": "the message store refused the request"})
    page.unroute(f"**/api/sessions/{first}/messages")
    _shot(page, "review-send-after-switch")
    # the second chat is shown: whatever the first chat's send came to is not in it
    assert page.locator("#log .msg.error", has_text="Not sent").count() == 0
    page.locator(f"li[data-id='{first}'] button.open").click()
    _until(page, f"localStorage.getItem('agent-current') === '{first}'")
    # ... but in the first, which does not wait for it forever (Stop, for nothing sent)
    assert page.locator("#send").inner_text() == "Send"
    assert page.locator("#log .msg.error", has_text="Not sent").count() == 1
    page.context.close()


def test_enter_that_ends_an_ime_composition_does_not_send(browser: Any, stack: Stack) -> None:
    """Typing Japanese, Chinese or Korean, Enter confirms the composed characters (a
    keydown with isComposing): the page sends the half-typed message instead."""
    page = _page(browser, stack, ALICE_TOKEN)
    page.click("#new")
    posts: list[str] = []
    page.on(
        "request",
        lambda r: (
            posts.append(r.url) if r.method == "POST" and r.url.endswith("/messages") else None
        ),
    )
    page.fill("#input", "にほんご")
    page.dispatch_event(
        "#input", "keydown", {"key": "Enter", "code": "Enter", "keyCode": 229, "isComposing": True}
    )
    page.dispatch_event("#input", "compositionend", {"data": "日本語"})
    page.fill("#input", "日本語")
    page.press("#input", "Enter")  # the real send
    _assistant(page, "re: 日本語").wait_for()
    assert len(posts) == 1, posts
    assert page.locator(".msg.user").count() == 1
    page.context.close()


def test_no_page_on_the_chat_origin_runs_script_from_another_site(stack: Stack) -> None:
    """The page keeps the bearer token in localStorage of the gateway's origin; /docs and
    /redoc, on that same origin and unauthenticated, load Swagger UI and ReDoc from
    cdn.jsdelivr.net by floating version (@5, @2), with no integrity hash and no CSP: the
    CDN (or whoever serves it) can read every user's token."""
    assert stack.lb is not None
    for path in ("/docs", "/redoc"):
        r = httpx.get(stack.lb.url + path, timeout=10)
        if r.status_code != 200:
            continue
        outside = re.findall(r'<script[^>]+src="(https?://[^"]+)"', r.text)
        csp = r.headers.get("content-security-policy", "")
        assert not outside or "script-src" in csp, f"{path} runs {outside} without a CSP"
        assert all("integrity=" in tag for tag in re.findall(r"<script[^>]+src=[^>]+>", r.text))
