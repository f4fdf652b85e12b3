"""kill -9 and a careless operator against real processes (a helper's attack, stop 52) (``agent-worker run`` workers,
``agent-gateway`` replicas, ``redis-server``), in the corners the existing crash tests
(test_crash_matrix, test_crash_soak*, test_restarts_and_stalls, test_stalled_workers,
test_failover_leftovers, test_gateway_soak) leave out: a worker stopped (SIGSTOP) and
woken beside a twin that took its id, a worker stopped by itself in the middle of a tool
call, a Redis restarted under a gateway's open streams and waiting requests. Each test
checks a promise of README.md / docs/ARCHITECTURE.md: every message exactly one terminal
answer that reaches its user; nothing left behind; a worker that lost its lease writes
nothing after another took over."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from replies import channel_events, collect, no_leftovers, until
from workers import WorkerProcess, crash_env

from bus_redis import FrontendClient, InboundMessage, Keys

pytestmark = [pytest.mark.real_redis, pytest.mark.slow]
K = Keys()
FAST = {
    "AGENT_LOCK_TTL_MS": "1000",
    "AGENT_OWNER_TTL_MS": "1500",
    "AGENT_SWEEP_INTERVAL_MS": "500",
    "AGENT_CHANNELS": "web",
}


def _m(chat: str, mid: str, text: str, **kw: Any) -> InboundMessage:
    return InboundMessage(id=mid, channel="web", sender_id="u", chat_id=chat, content=text, **kw)


def _worker(url: str, worker_id: str, llm: Any, env: dict[str, str] | None = None) -> WorkerProcess:
    return WorkerProcess(
        url,
        worker_id=worker_id,
        env={
            "AGENT_PROVIDER": "openai",
            "AGENT_MODEL": "fake-model",
            "OPENAI_BASE_URL": llm.base_url,
            "OPENAI_API_KEY": "test",
            **FAST,
            **(env or {}),
        },
    )


async def _beats_since(redis: aioredis.Redis, worker_id: str, after_ms: float) -> bool:
    seen = await redis.zscore(K.workers, worker_id)
    return seen is not None and float(seen) > after_ms


def _close(procs: dict[str, WorkerProcess | None]) -> None:
    """Each worker woken (it may be stopped), its log's end printed (shown when the test
    failed), and closed."""
    for name, proc in procs.items():
        if proc is not None:
            proc.signal(signal.SIGCONT)
            print(f"----- {name} -----\n" + proc.log()[-3000:])
            proc.close()


def _terminals(got: dict[str, list[Any]], mid: str) -> list[Any]:
    return [ev for ev in got.get(mid, []) if ev.is_terminal]


# --- 1. a stopped worker woken beside the twin that took its id ----------------------


async def test_a_stopped_worker_woken_beside_the_twin_that_took_its_id_leaves_private_sessions_alone(
    redis_server, real_redis, fake_llm
) -> None:  # type: ignore[no-untyped-def]
    """A careless operator (or a supervisor that saw a hung process: a paused VM, a
    container frozen by its cgroup) starts a second worker under the same
    ``AGENT_WORKER_ID`` while the first is stopped (SIGSTOP) past its heartbeat record:
    the start check lets it (the record ran out), and the stopped one is then woken
    (SIGCONT). README: a worker refuses to start beside a live worker with its id;
    registration.py: "two processes with one worker id would share an inbox and owner
    records (private sessions would fail at random)". Nothing told the woken process that
    its id was now another's (its heartbeat wrote the record again without looking at
    the claim): two live processes served under one id (a helper's attack, stop 52). Now
    its heartbeat (``heartbeat.lua``) finds the claim another's: it stops, exit 2, and
    private sessions opened afterwards live on, every question answered inside its own
    conversation."""
    url = redis_server.url
    old = _worker(url, "twin", fake_llm)
    new: WorkerProcess | None = None
    try:
        await until(lambda: _beats_since(real_redis, "twin", 0), timeout_s=20)
        old.signal(signal.SIGSTOP)

        async def record_gone() -> bool:  # 3 lease TTLs without a heartbeat
            return not await real_redis.exists(K.worker_info("twin"))

        await until(record_gone, timeout_s=20)
        new = _worker(url, "twin", fake_llm)

        async def new_claimed() -> bool:
            info = await real_redis.hgetall(K.worker_info("twin"))
            return info.get("pid") == str(new.proc.pid) and "started_ms" in info  # type: ignore[union-attr]

        await until(new_claimed, timeout_s=20)
        old.signal(signal.SIGCONT)
        # the woken process runs again: its heartbeat lands (a later one than now)
        now_ms = float((await real_redis.time())[0]) * 1000

        async def old_beats() -> bool:
            info = await real_redis.hgetall(K.worker_info("twin"))
            return info.get("pid") == str(old.proc.pid) or old.proc.poll() is not None

        woke = True
        try:
            await until(old_beats, timeout_s=8)
        except AssertionError:
            woke = False
        assert await _beats_since(real_redis, "twin", now_ms) or old.proc.poll() is not None

        client = FrontendClient(real_redis)
        keys = []
        for i in range(6):
            key, opened = await client.open_transient("web", f"tw{i}", session_key=f"web:tw{i}-p")
            got = await collect(client, "web", {opened}, timeout_s=20)
            keys.append(key)
        bad: list[str] = []
        for round_ in range(2):
            for i, key in enumerate(keys):
                mid = f"tw{i}-q{round_}"
                sent = await client.send(
                    _m(f"tw{i}", mid, f"[tw{i}] question {round_}", session_key_override=key,
                       require_existing_session=True)
                )  # fmt: skip
                got = await collect(client, "web", {sent}, timeout_s=20)
                [ev] = _terminals(got, sent)
                if (ev.type, ev.code) != ("message", None):
                    bad.append(f"{mid}: {ev.type}/{ev.code} by {ev.metadata.get('worker')}")
        both_alive = old.proc.poll() is None and new.proc.poll() is None
        assert not bad, (
            f"private sessions failed with two live processes under one id "
            f"(woken process beat again: {woke}, both alive: {both_alive}): {bad}"
        )
        # the woken one saw the id claimed at its next heartbeat and stopped, exit 2
        assert await asyncio.to_thread(old.proc.wait, 30) == 2
        assert "was claimed by pid" in old.log()
        assert new.proc.poll() is None
    finally:
        _close({"old twin": old, "new twin": new})


# --- 2. a worker stopped in the middle of a tool call, woken after the takeover --------


def _stopped(proc: WorkerProcess) -> bool:
    """The process is in state T (stopped by a signal)."""
    try:
        stat = Path(f"/proc/{proc.proc.pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] == "T"


async def _progress(redis: aioredis.Redis, key: str, content: str) -> list[str]:
    """The workers of the ``progress`` events of ``key`` whose text is ``content``."""
    out = []
    for _, fields in await redis.xrange(K.out(key)):
        doc = json.loads(fields["payload"])
        if doc.get("type") == "progress" and doc.get("content") == content:
            out.append(str(doc.get("metadata", {}).get("worker", "?")))
    return out


async def _noticed(redis: aioredis.Redis, worker_id: str) -> bool:
    """The woken worker counted the lease it lost (its own heartbeat says so)."""
    info = await redis.hgetall(K.worker_info(worker_id))
    return int(info.get("leases_lost", 0)) + int(info.get("fenced_writes_rejected", 0)) >= 1


TOOL_CASES = {
    "message": 'toolcall:message{"content": "effect TAG"}',
    "cron": 'toolcall:cron{"action": "add", "message": "ping TAG", "every_seconds": 3600}',
    "spawn": 'toolcall:spawn{"task": "look up TAG", "label": "TAG"}',
}


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("tool", sorted(TOOL_CASES))
async def test_a_worker_stopped_mid_tool_call_and_woken_after_the_takeover_writes_nothing(
    redis_server, real_redis, fake_llm, tmp_path, tool: str, when: str
) -> None:  # type: ignore[no-untyped-def]
    """The holder of a durable turn stops (SIGSTOP, every thread) inside a call of a
    non-idempotent tool (``message``, ``cron``, ``spawn``), just before the tool runs or
    just after it ran (its result not journaled). The other worker judges it dead,
    takes the session (a new lease nonce), replays the journal (the call's effect is
    unknown, it is not run again) and answers. Then the stopped worker is woken
    (SIGCONT) and goes on with its call where it stopped. README: tool effects at most
    once; a worker that lost its lease writes nothing. Expected: the message has one
    terminal event (the survivor's); the tool's effect exists at most once and never
    from the woken worker's "before" call (a progress event, a schedule, a subagent
    registration written after another holder took over); nothing is left behind."""
    tag = f"{tool}{when}"
    chat = f"st-{tag}"
    key = f"web:{chat}"
    text = TOOL_CASES[tool].replace("TAG", tag)
    env = crash_env(
        tmp_path, "worker.agent.tools.base:ToolRegistry.execute", when, f"'{tool}'", how="stop"
    )
    zombie = _worker(redis_server.url, "zombie", fake_llm, env)
    survivor: WorkerProcess | None = None
    try:
        await until(lambda: _beats_since(real_redis, "zombie", 0), timeout_s=20)
        client = FrontendClient(real_redis)
        mid = await client.send(_m(chat, f"{tag}-1", text))
        await until(lambda: _stopped(zombie), timeout_s=20)
        survivor = _worker(redis_server.url, "survivor", fake_llm)
        got = await collect(client, "web", {mid}, timeout_s=30)
        [answer] = _terminals(got, mid)
        assert answer.metadata.get("worker") == "survivor"
        zombie.signal(signal.SIGCONT)
        await until(lambda: _noticed(real_redis, "zombie"), timeout_s=20)
        # one more turn of the session, by whichever worker: the zombie has gone on since
        later = await client.send(_m(chat, f"{tag}-2", "and then"))
        got = await collect(client, "web", {mid, later}, timeout_s=30)

        assert len(_terminals(got, mid)) == 1
        assert len(_terminals(got, later)) == 1
        if tool == "message":
            effects = await _progress(real_redis, key, f"effect {tag}")
            assert len(effects) <= 1, effects
            assert "survivor" not in effects  # never run again
            if when == "before":
                assert effects == [], f"the woken worker's progress event was written: {effects}"
        elif tool == "cron":
            ids = await real_redis.smembers(K.crons(key))
            assert len(ids) <= 1, ids
            if when == "before":
                assert not ids, "the woken worker added a schedule after the takeover"
        else:
            spawned = await real_redis.hgetall(K.spawned(key))
            assert len(spawned) <= 1, spawned
            if when == "before":
                assert not spawned, f"the woken worker registered a subagent: {spawned}"
        if when == "after":  # the effect happened: the answer says it is unknown
            assert answer.metadata.get("resumed") == {"unknown_effects": [tool]}
        await no_leftovers(real_redis, [key])
    finally:
        _close({"zombie": zombie, "survivor": survivor})


# --- 3. a Redis restart (AOF, ACL file) under a gateway's open streams and waits --------


class _AofStack:
    """tests/stacks.py's deployment, on a redis-server with AOF and an ACL file (as the
    compose file runs it: users survive a restart): 2 gateway replicas, 2 workers."""

    def __init__(self, workers: int = 2, gateways: int = 2) -> None:
        import redis as sync_redis
        from fake_llm import FakeLLM
        from gateways import GatewayProcess
        from servers import RedisServer, require_redis_server
        from stacks import ALICE_TOKEN, BOB_TOKEN, GW_PW, WK_PW

        from bus_redis.acl import gateway_acl, worker_acl

        require_redis_server()
        self.dir = Path(__import__("tempfile").mkdtemp(prefix="h-acl-"))
        aclfile = self.dir / "users.acl"
        aclfile.write_text("")
        self.server = RedisServer(aof=True, extra=["--aclfile", str(aclfile)]).start()
        admin = sync_redis.Redis.from_url(self.server.url, decode_responses=True)
        for line in [*gateway_acl("web", GW_PW), *worker_acl(WK_PW)]:
            admin.execute_command(*line.split())
        admin.execute_command("ACL", "SAVE")
        admin.close()
        self.llm = FakeLLM().start()
        host = self.server.url.removeprefix("redis://")
        wenv = {
            "AGENT_PROVIDER": "openai",
            "AGENT_MODEL": "fake-model",
            "OPENAI_BASE_URL": self.llm.base_url,
            "OPENAI_API_KEY": "test",
            "AGENT_STREAM_DELTAS": "1",
        }
        self.workers = [
            WorkerProcess(f"redis://agent-worker:{WK_PW}@{host}", worker_id=f"aw{i}", env=wenv)
            for i in range(workers)
        ]
        self.gateways: list[Any] = []
        for i in range(gateways):
            self.gateways.append(
                GatewayProcess(
                    f"redis://gateway-web:{GW_PW}@{host}",
                    name=f"agw{i}",
                    env={
                        "AGENT_GATEWAY_TOKENS": f"{ALICE_TOKEN}=alice,{BOB_TOKEN}=bob",
                        "AGENT_GATEWAY_KEEPALIVE_S": "1",
                        "AGENT_GATEWAY_USER_BURST": "1000",
                    },
                )
            )

    def close(self) -> None:
        import shutil

        for proc in [*self.workers, *self.gateways]:
            name = getattr(proc, "worker_id", "") or getattr(proc, "name", "")
            print(f"----- log of {name} -----\n{proc.log()[-3000:]}")
            proc.close()
        self.llm.stop()
        self.server.cleanup()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.mark.frontend
async def test_a_redis_restart_under_open_streams_and_waits_reaches_every_user() -> None:
    """Redis (AOF, fsync always, users in an ACL file: nothing is lost) is restarted
    while two turns are held at the model: one whose user follows it on replica A's
    event stream (SSE), one whose user waits on replica B (``?wait=``). README: every
    message one terminal event, reaching the user who asked; a client on a stream resumes
    with ``Last-Event-ID`` when its stream ends. Expected: the SSE user gets the answer
    (on the open stream, or on a resumed one when the stream ended), the waiting user gets
    the answer (200, or 202/503/504 and then the answer by a re-post of its client id),
    and a message sent after the restart is answered on both replicas."""
    import httpx
    from sse import sse
    from stacks import ALICE, BOB

    stack = _AofStack()
    try:
        a, b = stack.gateways[0].url, stack.gateways[1].url
        async with httpx.AsyncClient(timeout=60) as http:
            r1 = await http.post(f"{a}/api/sessions", json={}, headers=ALICE)
            r2 = await http.post(f"{b}/api/sessions", json={}, headers=BOB)
            s1, s2 = r1.json()["id"], r2.json()["id"]
            sent = await http.post(
                f"{a}/api/sessions/{s1}/messages?wait=0",
                json={"content": "[s1] block across the restart", "client_id": "s1-1"},
                headers=ALICE,
            )
            assert sent.status_code in (200, 202), sent.text
            cursor = sent.json()["cursor"]
            seen: list[dict[str, Any]] = []
            stream_ended = asyncio.Event()

            async def follow(after: str) -> None:
                url = f"{a}/api/sessions/{s1}/events?after={after}"
                try:
                    async for ev in sse(http, url, headers=ALICE):
                        seen.append(ev)
                        if ev["event"] in ("message", "error"):
                            return
                except httpx.HTTPError:
                    pass
                stream_ended.set()

            follower = asyncio.create_task(follow(cursor))
            assert await asyncio.to_thread(stack.llm.started.wait, 20)

            async def wait_b() -> httpx.Response:
                body = {"content": "[s2] block too", "client_id": "s2-1"}
                return await http.post(
                    f"{b}/api/sessions/{s2}/messages?wait=40", json=body, headers=BOB
                )

            waiter = asyncio.create_task(wait_b())

            async def two_held() -> bool:
                return sum("block" in json.dumps(r) for r in stack.llm.requests) >= 2

            await until(two_held, timeout_s=20)
            stack.server.stop()
            stack.server.start()  # same port, same AOF and ACL file
            stack.llm.release()

            # the SSE user: on the open stream, or on a resumed one once it ended
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 40
            while not any(e["event"] in ("message", "error") for e in seen):
                assert loop.time() < deadline, (
                    f"no answer on replica A's stream 40 s after the restart "
                    f"(stream ended: {stream_ended.is_set()}, seen: {[e['event'] for e in seen]})"
                )
                if follower.done():
                    last = seen[-1]["id"] if seen else cursor
                    follower = asyncio.create_task(follow(last))
                await asyncio.sleep(0.05)  # poll: the events come from other processes
            terminal = [e for e in seen if e["event"] in ("message", "error")]
            assert [(e["event"], e["data"]["content"]) for e in terminal] == [
                ("message", "re: [s1] block across the restart")
            ]

            # the waiting user: its answer, or (after a 5xx/202) by re-posting its id
            r = await waiter
            for _ in range(5):
                if r.status_code == 200:
                    break
                assert r.status_code in (202, 503, 504), (r.status_code, r.text)
                body = {"content": "[s2] block too", "client_id": "s2-1"}
                r = await http.post(
                    f"{b}/api/sessions/{s2}/messages?wait=20", json=body, headers=BOB
                )
            assert r.status_code == 200, (r.status_code, r.text)
            assert r.json()["event"]["content"] == "re: [s2] block too"

            for base, sid, user in ((a, s2, BOB), (b, s1, ALICE)):
                r = await http.post(
                    f"{base}/api/sessions/{sid}/messages?wait=20",
                    json={"content": f"after {sid}"},
                    headers=user,
                )
                assert r.status_code == 200, (r.status_code, r.text)
                assert r.json()["event"]["content"] == f"re: after {sid}"
            follower.cancel()
    finally:
        stack.close()


# --- 4. kill -9 of the replica serving an OpenAI stream; the retry on the other ---------


async def _openai_stream(http: Any, base: str, headers: dict[str, str], text: str) -> str:
    """The text an OpenAI streaming client assembles (until ``[DONE]``)."""
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": text}]}
    out = ""
    async with http.stream(
        "POST", f"{base}/v1/chat/completions", json=body, headers=headers
    ) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                break
            doc = json.loads(data)
            assert "error" not in doc, doc
            out += doc["choices"][0]["delta"].get("content") or ""
    return out


@pytest.mark.frontend
async def test_an_openai_stream_cut_by_a_replica_kill_is_answered_once_by_its_retry() -> None:
    """An OpenAI client streams an answer from replica A (two pieces arrived, the rest is
    held at the model) and A is killed -9. The client sends the request again, with its
    ``Idempotency-Key``, to replica B (openai_compat.py: "sent again (a retry after a
    replica died under it) it is answered with the first answer"). Expected: B's stream
    assembles the whole answer, the question reached the model once, and the history
    holds it once."""
    import httpx
    from stacks import ALICE, running_stack

    with running_stack(gateways=2, workers=2) as stack:
        stack.llm.rearm()
        text = "midway tale of the killed replica"
        headers = {**ALICE, "Idempotency-Key": "oa-kill-1", "X-Session-Id": ""}
        async with httpx.AsyncClient(timeout=60) as http:
            r = await http.post(f"{stack.a}/api/sessions", json={}, headers=ALICE)
            sid = r.json()["id"]
            headers["X-Session-Id"] = sid
            pieces: list[str] = []
            first_two = asyncio.Event()

            async def on_a() -> None:
                body = {
                    "model": "m",
                    "stream": True,
                    "messages": [{"role": "user", "content": text}],
                }
                try:
                    async with http.stream(
                        "POST", f"{stack.a}/v1/chat/completions", json=body, headers=headers
                    ) as resp:
                        async for line in resp.aiter_lines():
                            if line.startswith("data: {"):
                                delta = json.loads(line[6:])["choices"][0]["delta"]
                                if delta.get("content"):
                                    pieces.append(delta["content"])
                                    if len(pieces) >= 2:
                                        first_two.set()
                except httpx.HTTPError:
                    pass

            task = asyncio.create_task(on_a())
            await asyncio.wait_for(first_two.wait(), 20)
            stack.gateways[0].kill()
            await asyncio.wait_for(task, 10)
            retry = asyncio.create_task(_openai_stream(http, stack.b, headers, text))

            async def asked_twice_or_settled() -> bool:
                return retry.done() or len(stack.llm.requests) >= 1

            await until(asked_twice_or_settled, timeout_s=10)
            stack.llm.release()
            got = await asyncio.wait_for(retry, 40)

            assert got == f"re: {text}"
            calls = [q for q in stack.llm.requests if text in json.dumps(q)]
            assert len(calls) == 1, f"{len(calls)} model calls for one question"
            hist = (await http.get(f"{stack.b}/api/sessions/{sid}/messages", headers=ALICE)).json()
            assert [h["content"] for h in hist if h["role"] == "user"] == [text]


# --- 5. a worker killed while a user's chat is backlogged at the gateway ----------------


@pytest.mark.frontend
async def test_a_backlogged_chat_whose_worker_is_killed_drains_and_takes_messages_again() -> None:
    """A user's chat holds as many entries as the gateway lets wait
    (``AGENT_GATEWAY_MAX_WAITING_PER_CHAT`` 3): one turn held at the model, two queued;
    a fourth is refused (429). The worker is killed -9 and another started. Expected:
    each of the three gets exactly one answer, in order, by the new worker; the chat then
    takes messages again (the backlog counted nothing that is gone); nothing is left."""
    import httpx
    from stacks import ALICE, running_stack

    env = {"AGENT_GATEWAY_MAX_WAITING_PER_CHAT": "3"}
    with running_stack(gateways=1, workers=1, gateway_env=env) as stack:
        stack.llm.rearm()
        async with httpx.AsyncClient(timeout=60) as http:
            sid = (await http.post(f"{stack.a}/api/sessions", json={}, headers=ALICE)).json()["id"]
            url = f"{stack.a}/api/sessions/{sid}/messages"
            first = await http.post(
                f"{url}?wait=0", json={"content": "[bk] block one", "client_id": "bk-1"},
                headers=ALICE,
            )  # fmt: skip
            cursor = first.json()["cursor"]
            assert await asyncio.to_thread(stack.llm.started.wait, 20)
            for i in (2, 3):
                r = await http.post(
                    f"{url}?wait=0", json={"content": f"[bk] then {i}", "client_id": f"bk-{i}"},
                    headers=ALICE,
                )  # fmt: skip
                assert r.status_code == 202, r.text
            r = await http.post(
                f"{url}?wait=0", json={"content": "[bk] one too many"}, headers=ALICE
            )
            assert r.status_code == 429, r.text
            stack.workers[0].kill()
            stack.start_worker("gw-w-after")
            stack.llm.release()

            from sse import sse

            terminals: list[dict[str, Any]] = []

            async def read() -> None:
                async for ev in sse(http, f"{stack.a}/api/sessions/{sid}/events?after={cursor}",
                                    headers=ALICE):  # fmt: skip
                    if ev["event"] in ("message", "error"):
                        terminals.append(ev)
                        done = set()
                        for e in terminals:
                            done |= {e["data"].get("reply_to"), *(e["data"].get("covers") or [])}
                        if done >= {"bk-1", "bk-2", "bk-3"}:
                            return

            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(read(), 40)
            answers = [
                (
                    e["data"].get("reply_to"),
                    e["data"].get("covers"),
                    e["event"],
                    e["data"]["content"],
                )
                for e in terminals
            ]
            named = [
                r
                for e in terminals
                for r in {e["data"].get("reply_to"), *(e["data"].get("covers") or [])}
            ]
            assert sorted(named) == ["bk-1", "bk-2", "bk-3"], answers
            for i in range(3):  # the chat takes a full backlog again
                r = await http.post(
                    f"{url}?wait=20", json={"content": f"[bk] again {i}"}, headers=ALICE
                )
                assert r.status_code == 200, r.text
            status = (await http.get(f"{stack.a}/api/sessions/{sid}", headers=ALICE)).json()
            assert status["queued"] == 0, status
            assert status["state"] == "idle", status
            redis = aioredis.from_url(stack.server.url, decode_responses=True)
            try:
                await no_leftovers(redis, [f"web:{sid}"])
            finally:
                await redis.aclose()


async def test_a_stopped_worker_woken_beside_the_twin_that_took_its_id_writes_no_durable_turn(
    redis_server, real_redis, fake_llm
) -> None:  # type: ignore[no-untyped-def]
    """The same careless restart as above, with a durable turn held at the model when the
    first process is stopped (SIGSTOP). The twin started under the id takes the lease
    over (a new nonce) and runs the turn again; then the stopped one is woken and its
    held model call answered. Both hold a lease naming the same worker id. Expected (the
    lease's nonce fences it): one terminal event, the twin's; the history holds the turn
    once; nothing is left."""
    old = _worker(redis_server.url, "twin2", fake_llm)
    new: WorkerProcess | None = None
    try:
        await until(lambda: _beats_since(real_redis, "twin2", 0), timeout_s=20)
        client = FrontendClient(real_redis)
        held: list[str] = []
        fake_llm.on_block = held.append
        mid = await client.send(_m("dt", "dt-1", "[dt] block durable"))
        await until(lambda: len(held) >= 1, timeout_s=20)
        old.signal(signal.SIGSTOP)

        async def record_gone() -> bool:
            return not await real_redis.exists(K.worker_info("twin2"))

        await until(record_gone, timeout_s=20)
        new = _worker(redis_server.url, "twin2", fake_llm)
        await until(lambda: len(held) >= 2, timeout_s=30)  # the twin's re-run, held too
        old.signal(signal.SIGCONT)
        fake_llm.release()
        got = await collect(client, "web", {mid}, timeout_s=30)
        later = await client.send(_m("dt", "dt-2", "[dt] after"))
        got = await collect(client, "web", {mid, later}, timeout_s=30)

        assert len(_terminals(got, mid)) == 1, [e.model_dump() for e in _terminals(got, mid)]
        assert len(_terminals(got, later)) == 1
        h = await real_redis.hgetall(K.session("web:dt"))
        users = [json.loads(h[f"m:{i}"]) for i in range(int(h["count"]))]
        assert [r["content"] for r in users if r["role"] == "user"] == [
            "[dt] block durable",
            "[dt] after",
        ]
        await no_leftovers(real_redis, ["web:dt"])
    finally:
        _close({"old twin": old, "new twin": new})


async def test_two_workers_started_at_once_under_one_id_leave_one_serving(
    redis_server, real_redis, fake_llm
) -> None:  # type: ignore[no-untyped-def]
    """A careless operator starts two workers with one ``AGENT_WORKER_ID`` at the same
    moment. README: a worker refuses to start (one line, exit 2) beside a live worker
    with its id. Expected: exactly one of the two exits 2, the other serves."""
    procs = [_worker(redis_server.url, "same", fake_llm) for _ in range(2)]
    try:
        await until(lambda: _beats_since(real_redis, "same", 0), timeout_s=20)

        def one_exited() -> bool:
            return any(p.proc.poll() is not None for p in procs)

        await until(one_exited, timeout_s=20)
        codes = sorted(str(p.proc.poll()) for p in procs)
        assert codes == ["2", "None"], codes
        client = FrontendClient(real_redis)
        mid = await client.send(_m("same", "same-1", "hello"))
        got = await collect(client, "web", {mid}, timeout_s=20)
        assert [e.type for e in _terminals(got, mid)] == ["message"]
    finally:
        for p in procs:
            print("----- same -----\n" + p.log()[-2000:])
            p.close()


async def test_a_private_session_reported_lost_at_a_twins_start_is_not_revived_by_the_woken_one(
    redis_server, real_redis, fake_llm
) -> None:  # type: ignore[no-untyped-def]
    """The first process under an id owns a private session and is stopped (SIGSTOP);
    a twin started under the id ends that session at its start (registration.py
    ``end_former_private``: the record dropped, ``session_lost`` told). The first process
    is woken (SIGCONT) with the session still in its memory, and the twin is descheduled
    for a moment (SIGSTOP), so the woken one reads the next message of the key. README: a
    private session dies with its worker; after ``session_lost`` its messages are
    ``session_not_active``. Expected: the next message is refused as not active and the
    model is never asked it; no owner record names the key again."""
    old = _worker(redis_server.url, "twin3", fake_llm)
    new: WorkerProcess | None = None
    try:
        await until(lambda: _beats_since(real_redis, "twin3", 0), timeout_s=20)
        client = FrontendClient(real_redis)
        key, opened = await client.open_transient("web", "lp", session_key="web:lp-p")
        await collect(client, "web", {opened}, timeout_s=20)
        first = await client.send(
            _m("lp", "lp-1", "[lp] remember 42", session_key_override=key,
               require_existing_session=True)
        )  # fmt: skip
        got = await collect(client, "web", {first}, timeout_s=20)
        assert [e.type for e in _terminals(got, first)] == ["message"]
        old.signal(signal.SIGSTOP)

        async def record_gone() -> bool:
            return not await real_redis.exists(K.worker_info("twin3"))

        await until(record_gone, timeout_s=20)
        new = _worker(redis_server.url, "twin3", fake_llm)

        async def lost() -> bool:
            return any(
                e.code == "session_lost" and e.session_key == key
                for e in await channel_events(client, "web")
            )

        await until(lost, timeout_s=20)
        # the twin stopped and the first woken: the first reads what comes until its next
        # heartbeat finds the id claimed (then it stops)
        new.signal(signal.SIGSTOP)
        old.signal(signal.SIGCONT)
        try:
            asked = len(fake_llm.requests)
            after = await client.send(
                _m("lp", "lp-2", "[lp] what was the number?", session_key_override=key,
                   require_existing_session=True)
            )  # fmt: skip
            # it refuses it, or its next heartbeat finds the id claimed and it stops (2)
            await until(lambda: old.proc.poll() is not None, timeout_s=20)
            assert old.proc.returncode == 2
        finally:
            new.signal(signal.SIGCONT)
        got = await collect(client, "web", {after}, timeout_s=20)
        [ev] = _terminals(got, after)
        revived = await real_redis.hget(K.owner(key), "worker")
        assert (ev.type, ev.code) == ("error", "session_not_active"), (
            f"a private session reported lost answered again: {ev.type}/{ev.code} "
            f"{ev.content!r} by {ev.metadata.get('worker')}; owner record now {revived!r}"
        )
        assert len(fake_llm.requests) == asked
        assert revived is None
    finally:
        _close({"old twin": old, "new twin": new})


@pytest.mark.parametrize(
    "target",
    [
        "bus_redis.streams:RedisBus.consolidate",
        "session_store.redis_store:RedisSessionStore.delete_held",
    ],
)
async def test_a_worker_stopped_mid_new_and_woken_after_the_takeover_folds_once(
    redis_server, real_redis, fake_llm, tmp_path, target: str
) -> None:  # type: ignore[no-untyped-def]
    """A ``new`` marker's fold (the summary's fenced write, then the history's deletion)
    is cut by a SIGSTOP of its worker just before the step; the other worker takes the
    session over and carries the marker out; the stopped one is then woken (SIGCONT) and
    goes on with the step with its old lease. README: the fold is fenced, under the lease.
    Expected: the memory holds the fold once, the history is the new conversation only,
    and the woken worker's late write changes neither."""
    env = crash_env(tmp_path, target, "before", "", how="stop")
    zombie = _worker(redis_server.url, "zn", fake_llm, env)
    survivor: WorkerProcess | None = None
    try:
        client = FrontendClient(real_redis)
        first = await client.send(_m("nw", "nw-1", "my cat is called Tom"))
        await collect(client, "web", {first}, timeout_s=20)
        await client.new("web:nw")
        await until(lambda: _stopped(zombie), timeout_s=20)
        survivor = _worker(redis_server.url, "sn", fake_llm)
        later = await client.send(_m("nw", "nw-2", "fresh start"))
        got = await collect(client, "web", {later}, timeout_s=30)
        assert [e.type for e in _terminals(got, later)] == ["message"]
        zombie.signal(signal.SIGCONT)  # its step runs first: it was stopped inside it
        now_ms = float((await real_redis.time())[0]) * 1000
        await until(lambda: _beats_since(real_redis, "zn", now_ms + 500), timeout_s=20)
        third = await client.send(_m("nw", "nw-3", "still fresh"))
        await collect(client, "web", {third}, timeout_s=30)

        h = await real_redis.hgetall(K.session("web:nw"))
        rows = [json.loads(h[f"m:{i}"])["content"] for i in range(int(h["count"]))]
        assert [r for r in rows if not r.startswith("re:")] == ["fresh start", "still fresh"]
        memory = (await real_redis.hgetall(K.memory("web/sender:u"))).get("content", "")
        assert memory.count("user: my cat is called Tom") == 1, memory
        assert await real_redis.xlen(K.memory_history("web/sender:u")) == 1
        await no_leftovers(real_redis, ["web:nw"])
    finally:
        _close({"zombie": zombie, "survivor": survivor})
