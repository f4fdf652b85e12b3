"""The whole deployment under kill -9: two gateway replicas behind a round-robin load
balancer, three workers, two users with three chats each sending five messages one after
another (``?wait=``, a ``client_id`` each, re-posted with the same id when a request
fails, as a client does). A seeded random killer takes a worker each time six more
messages were answered (three times) and one gateway replica after the second. The user
sees what the README promises: each message answered with its own answer, and the
stored history every message once, in order."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import httpx
import pytest
from gateways import LoadBalancer
from stacks import ALICE, BOB, running_stack

pytestmark = [pytest.mark.real_redis, pytest.mark.slow, pytest.mark.frontend]
CHATS, MESSAGES, KILLS, EVERY = 3, 5, 3, 6


async def _post(
    http: httpx.AsyncClient, url: str, headers: dict[str, str], body: dict[str, Any]
) -> dict[str, Any]:
    """Post until answered: a replica killed under the request, or a wait that ran out
    while the chat's worker was replaced, is posted again with the same client_id."""
    for _ in range(20):
        try:
            r = await http.post(url, json=body, headers=headers, params={"wait": 20})
        except httpx.TransportError:
            continue
        if r.status_code == 200:
            return dict(r.json()["event"])
        assert r.status_code in (202, 502, 503, 504), (r.status_code, r.text)
    raise AssertionError(f"no answer to {body['client_id']}")


async def test_the_deployment_answers_each_message_once_under_kills() -> None:
    rng = random.Random(20261205)
    with running_stack(gateways=2, workers=3) as stack:
        stack.llm.latency_s = (0.005, 0.03)
        lb = LoadBalancer([g.port for g in stack.gateways])
        answered: dict[str, dict[str, Any]] = {}
        progress = asyncio.Event()
        at: list[int] = []  # answered when each kill came
        try:
            async with httpx.AsyncClient(timeout=60) as http:
                chats = []
                for user in (ALICE, BOB):
                    for _ in range(CHATS):
                        r = await http.post(f"{lb.url}/api/sessions", json={}, headers=user)
                        chats.append((user, r.json()["id"]))

                async def talk(user: dict[str, str], sid: str) -> None:
                    for i in range(MESSAGES):
                        body = {"content": f"{sid} says {i}", "client_id": f"{sid[-8:]}-{i}"}
                        url = f"{lb.url}/api/sessions/{sid}/messages"
                        answered[body["client_id"]] = await _post(http, url, user, body)
                        progress.set()

                talking = asyncio.gather(*(talk(u, s) for u, s in chats))
                for n in range(KILLS):
                    while len(answered) < EVERY * (n + 1) and not talking.done():
                        progress.clear()
                        await progress.wait()
                    at.append(len(answered))
                    victim = stack.workers.pop(rng.randrange(len(stack.workers)))
                    victim.kill()
                    stack.start_worker(f"gw-w-again{n}")
                    if n == 1:
                        stack.gateways[0].kill()  # its clients reconnect to the other
                await talking

                for user, sid in chats:
                    for i in range(MESSAGES):
                        ev = answered[f"{sid[-8:]}-{i}"]
                        assert (ev["type"], ev["content"]) == ("message", f"re: {sid} says {i}")
                    r = await http.get(f"{stack.b}/api/sessions/{sid}/messages", headers=user)
                    users = [h["content"] for h in r.json() if h["role"] == "user"]
                    assert users == [f"{sid} says {i}" for i in range(MESSAGES)]
                assert at[-1] < len(chats) * MESSAGES, at  # each kill came mid-work
        finally:
            lb.close()
