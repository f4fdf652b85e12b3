"""The chat page in a real browser: Debian's chromium driven by Playwright (Python), against
two gateway replicas behind a load balancer (one replica serves until it is killed), two
worker processes and a local fake LLM that streams deltas.

Screenshots are kept in ``$TEST_ARTIFACTS`` (default ``test-artifacts/``) as test artifacts.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from browser import TIMEOUT_MS
from browser import assistant as _assistant
from browser import say as _say
from browser import shot as _shot
from browser import signed_in as _page
from browser import until_js as _until
from stacks import ALICE_TOKEN, BOB_TOKEN, Stack, running_stack

pytestmark = [pytest.mark.real_redis, pytest.mark.slow, pytest.mark.frontend]


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with running_stack(gateways=2, workers=2, failover_lb=True) as st:
        yield st


def test_send_stream_stop_and_a_temporary_chat(browser: Any, stack: Stack) -> None:
    page = _page(browser, stack, ALICE_TOKEN)
    _say(page, "hello page")
    _assistant(page, "re: hello page").wait_for()
    # the list is refreshed beside the send, not before the answer: it may come after it
    _until(page, "document.querySelectorAll('[data-testid=session]').length === 1")
    hostile = "<b>bold</b><img src=x onerror=window.pwned=1>"
    _say(page, hostile)
    _assistant(page, "re: <b>bold</b>").wait_for()
    assert page.locator("#log b, #log img").count() == 0  # text, never HTML
    assert page.evaluate("window.pwned === undefined")
    assert page.locator(".msg:empty").count() == 0  # nothing said without words
    _shot(page, "page-streamed-reply")

    stack.llm.rearm()
    _say(page, "block until stopped")
    assert stack.llm.started.wait(20)
    page.wait_for_selector("#send.stop")  # Send became Stop while the turn runs
    _say(page, "queued behind it")
    page.locator(".msg.user", has_text="queued behind it").locator(
        ".tag", has_text="queued"
    ).wait_for()
    # the input is empty again: once it shows Stop (not at once: the second click of a
    # send's double click must not stop it), the button is Stop
    page.wait_for_selector("#send.stop")
    page.click("#send")
    # the stop covers the running message and the one queued before it
    page.locator(".msg.error").nth(1).wait_for()
    assert page.locator(".msg.error", has_text="Stopped.").count() == 2
    page.wait_for_selector("#send:not(.stop)")
    assert page.evaluate("window.badgeHistory") == ["reconnecting", "connected"]  # no drop
    _shot(page, "page-stopped")
    stack.llm.release()

    page.check("#temporary")
    page.click("#new")
    page.get_by_test_id("temp-banner").wait_for(state="visible")
    _say(page, "a private thought")
    _assistant(page, "re: a private thought").wait_for()
    assert page.locator("[data-testid=session]").count() == 1  # temporary chats are not listed
    _shot(page, "page-temporary-chat")
    page.click("#discard")
    page.locator(".msg.system", has_text="Temporary chat discarded.").wait_for()
    page.context.close()


def test_reload_mid_reply_resumes_without_loss_or_doubling(browser: Any, stack: Stack) -> None:
    page = _page(browser, stack, ALICE_TOKEN)
    page.click("#new")
    stack.llm.rearm()
    _say(page, "midway through a reload")
    assert stack.llm.started.wait(20)
    page.locator(".msg.assistant").last.wait_for()  # the first deltas are shown
    page.reload()
    page.wait_for_selector("#badge.connected")
    stack.llm.release()
    final = "re: midway through a reload"
    _assistant(page, final).wait_for()
    _until(page, "document.querySelector('#send').textContent === 'Send'")
    assert _assistant(page, final).count() == 1
    assert page.locator(".msg.assistant").last.inner_text().strip() == final
    _shot(page, "page-after-reload")
    page.context.close()


def test_the_page_survives_the_death_of_its_replica(browser: Any, stack: Stack) -> None:
    page = _page(browser, stack, ALICE_TOKEN)
    page.click("#new")
    stack.llm.rearm()
    _say(page, "midway while a replica dies")
    assert stack.llm.started.wait(20)
    page.locator(".msg.assistant").last.wait_for()
    stack.gateways[0].kill()  # the replica serving the page and its event stream
    _until(page, "(window.badgeHistory || []).includes('reconnecting')")
    page.wait_for_selector("#badge.connected")
    stack.llm.release()
    final = "re: midway while a replica dies"
    _assistant(page, final).wait_for()
    _until(page, "document.querySelector('#send').textContent === 'Send'")
    assert _assistant(page, final).count() == 1
    assert page.locator(".msg.assistant").last.inner_text().strip() == final
    _say(page, "after the replica died")
    _assistant(page, "re: after the replica died").wait_for()
    _shot(page, "page-after-replica-death")
    page.context.close()


def test_a_provider_error_is_retried_with_the_same_message_id(browser: Any, stack: Stack) -> None:
    page = _page(browser, stack, ALICE_TOKEN)
    page.click("#new")
    _say(page, "a flaky question")
    page.locator(".msg.error", has_text="The model provider failed.").wait_for()
    _shot(page, "page-provider-error")
    page.get_by_test_id("retry").click()
    _assistant(page, "re: a flaky question").wait_for()
    assert page.locator(".msg.user", has_text="a flaky question").count() == 1
    history = page.evaluate(
        """async () => {
            const id = localStorage.getItem("agent-current");
            const r = await fetch(`/api/sessions/${id}/messages`,
                {headers: {Authorization: "Bearer " + localStorage.getItem("agent-token")}});
            return (await r.json()).map((m) => m.role + ": " + m.content);
        }"""
    )
    assert history == ["user: a flaky question", "assistant: re: a flaky question"]
    page.context.close()


def test_a_message_typed_while_a_chat_opens_goes_to_that_chat(browser: Any, stack: Stack) -> None:
    """The history of a new chat is held back (a slow network): the message typed meanwhile
    waits for the chat, is sent once, into it, and its bubble survives the late history."""
    page = _page(browser, stack, ALICE_TOKEN)
    before = page.locator("[data-testid=session]").count()
    held: list[Any] = []

    def hold(route: Any) -> None:
        if route.request.method == "GET":
            held.append(route)
        else:
            route.continue_()

    page.route("**/api/sessions/*/messages", hold)
    page.click("#new")
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    while not held:
        assert time.monotonic() < deadline, "the history was never asked for"
        page.wait_for_timeout(20)
    _say(page, "typed while loading")
    page.wait_for_timeout(100)  # the page has had its chance to send too early
    held[0].continue_()
    page.unroute("**/api/sessions/*/messages")
    _assistant(page, "re: typed while loading").wait_for()
    assert page.locator(".msg.user", has_text="typed while loading").count() == 1
    _until(page, f"document.querySelectorAll('[data-testid=session]').length === {before + 1}")
    page.context.close()


def test_another_users_chats_never_appear(browser: Any, stack: Stack) -> None:
    alice = _page(browser, stack, ALICE_TOKEN)
    assert alice.locator("[data-testid=session]").count() >= 1
    alice.context.close()
    bob = _page(browser, stack, BOB_TOKEN)
    assert bob.locator("[data-testid=session]").count() == 0
    _say(bob, "bob here")
    _assistant(bob, "re: bob here").wait_for()
    assert bob.locator("[data-testid=session]").count() == 1
    assert bob.locator(".msg", has_text="hello page").count() == 0
    _shot(bob, "page-other-user")
    bob.context.close()


def test_slash_new_starts_a_fresh_conversation(browser: Any, stack: Stack) -> None:
    page = _page(browser, stack, ALICE_TOKEN)
    page.click("#new")
    _say(page, "my name is Ada")
    _assistant(page, "re: my name is Ada").wait_for()
    _say(page, "/new")
    page.locator(".msg.system", has_text="New conversation").wait_for()
    assert page.locator(".msg.user", has_text="/new").count() == 0  # a command, not a message
    _say(page, "who am I?")
    _assistant(page, "re: who am I?").wait_for()
    requests = [r for r in stack.llm.requests if "who am I?" in str(r["messages"])]
    assert requests
    assert "my name is Ada" not in str(requests[-1]["messages"][1:])  # the old rows are gone
    _shot(page, "page-new-conversation")
    page.context.close()


def _second_attempts_last_delta(stack: Stack, piece: str) -> str:
    """The entry id of the second ``piece`` delta on any session's event stream (the
    attempt that took over streamed it again), once it is there."""
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    while time.monotonic() < deadline:
        for key in stack.admin.scan_iter(match="*:out:*", count=1000):
            ids = [
                eid
                for eid, fields in stack.admin.xrange(key)
                if f'"content":"{piece}"' in fields.get("payload", "")
                and '"type":"delta"' in fields.get("payload", "")
            ]
            if len(ids) >= 2:
                return str(ids[1])
        time.sleep(0.02)  # polled: the worker writes it on its own time
    raise AssertionError(f"no second {piece!r} delta")


def test_a_refused_send_or_stop_is_said_once_and_not_retried(browser: Any, stack: Stack) -> None:
    """A 429 (too much of the user's waiting for the workers) is a refusal, not a lost
    replica: the page says why, once, and does not post again; a refused stop is said
    too (it was silent). A 429 of the user's rate, which says when to come back, is
    waited out and sent. The gateway's answer is replaced in the browser."""
    page = _page(browser, stack, ALICE_TOKEN)
    _say(page, "first")
    _assistant(page, "re: first").wait_for()
    detail = {"detail": "10 messages are waiting in this chat (at most 10): wait for them"}
    posts: list[str] = []

    def refuse(route: Any) -> None:
        posts.append(route.request.url)
        route.fulfill(status=429, json=detail)

    page.route("**/api/sessions/*/messages", refuse)
    _say(page, "one too many")
    page.locator(".msg.error", has_text="Not sent: 10 messages are waiting").wait_for()
    assert len(posts) == 1  # a 429 is not retried (a 503 would be)
    page.unroute("**/api/sessions/*/messages")
    stack.llm.rearm()
    _say(page, "block until stopped")
    assert stack.llm.started.wait(20)
    page.wait_for_selector("#send.stop")
    page.route("**/api/sessions/*/stop", refuse)
    page.click("#send")  # Stop, refused
    page.locator(".msg.error", has_text="Not stopped: 10 messages are waiting").wait_for()
    assert len(posts) == 2
    page.unroute("**/api/sessions/*/stop")
    page.click("#send")  # Stop again, now through
    page.locator(".msg.error", has_text="Stopped.").wait_for()
    stack.llm.release()
    # a 429 of the user's rate says when to come back (Retry-After): waited out, then sent
    tries: list[str] = []

    def later(route: Any) -> None:
        tries.append(route.request.url)
        if len(tries) == 1:
            detail = {"detail": "too many requests: 20 a second at most, 100 at once"}
            route.fulfill(status=429, headers={"Retry-After": "1"}, json=detail)
        else:
            route.continue_()

    page.route("**/api/sessions/*/messages", later)
    _say(page, "after a moment")
    _assistant(page, "re: after a moment").wait_for()
    assert len(tries) == 2
    page.unroute("**/api/sessions/*/messages")
    _shot(page, "page-refusals")
    page.context.close()


def test_an_answer_begun_by_a_lost_worker_is_not_shown_twice(browser: Any, stack: Stack) -> None:
    """kill -9 of the workers mid-answer: another takes the turn over and streams it again
    from its start (its events number from 1 again); the page shows that attempt's text,
    not the lost one's followed by it, and then the answer once. (Last in the module: the
    stack's workers are replaced.)"""
    page = _page(browser, stack, ALICE_TOKEN)
    page.click("#new")
    stack.llm.rearm()
    stack.llm.started.clear()
    _say(page, "midway while its worker dies")
    assert stack.llm.started.wait(20)
    shown = "[...document.querySelectorAll('.msg.assistant')].at(-1)?.firstChild?.textContent"
    _until(page, f"{shown} === 're: midw'")  # the lost attempt's first pieces
    stack.llm.started.clear()
    for worker in list(stack.workers):
        worker.kill()
    stack.start_worker("gw-w-after")
    assert stack.llm.started.wait(30)  # the new attempt streams its first pieces again
    second = _second_attempts_last_delta(stack, "midw")
    marker = f'"cursor":"{second}"'
    seen = f"Object.values(sessionStorage).some((v) => v.includes('{marker}'))"
    _until(page, seen)  # the page has taken the new attempt's pieces
    assert page.evaluate(shown) == "re: midw"  # that attempt's, not the lost one's and it
    stack.llm.release()
    final = "re: midway while its worker dies"
    _assistant(page, final).wait_for()
    assert _assistant(page, final).count() == 1
    assert page.locator(".msg.assistant").last.inner_text().strip() == final
    _shot(page, "page-after-worker-death")
    page.context.close()
