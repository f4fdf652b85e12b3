"""A whole deployment for gateway tests: a redis-server, ACL users, a fake LLM, worker
processes and gateway replicas (optionally behind a load balancer)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import redis
from fake_llm import FakeLLM
from gateways import GatewayProcess, LoadBalancer
from servers import RedisServer, require_redis_server
from workers import WorkerProcess

from bus_redis.acl import gateway_acl, worker_acl

GW_PW, WK_PW = "gw-s3cret-pw", "wk-s3cret-pw"
ALICE_TOKEN, BOB_TOKEN = "tok-alice-0123456789", "tok-bob-0123456789"
ALICE = {"Authorization": f"Bearer {ALICE_TOKEN}"}
BOB = {"Authorization": f"Bearer {BOB_TOKEN}"}


@dataclass
class Stack:
    server: RedisServer
    admin: redis.Redis
    llm: FakeLLM
    gateways: list[GatewayProcess]
    workers: list[WorkerProcess]
    lb: LoadBalancer | None = None
    extra: dict[str, str] = field(default_factory=dict)
    worker_url: str = ""
    worker_env: dict[str, str] = field(default_factory=dict)

    def start_worker(self, worker_id: str) -> WorkerProcess:
        """One more worker process as the stack's own (stopped with the stack)."""
        proc = WorkerProcess(self.worker_url, worker_id=worker_id, env=self.worker_env)
        self.workers.append(proc)
        return proc

    @property
    def a(self) -> str:
        return self.gateways[0].url

    @property
    def b(self) -> str:
        return self.gateways[1].url


@contextlib.contextmanager
def running_stack(
    *,
    gateways: int,
    workers: int,
    failover_lb: bool = False,
    gateway_env: dict[str, str] | None = None,
) -> Iterator[Stack]:
    require_redis_server()
    server = RedisServer().start()
    admin = redis.Redis.from_url(server.url, decode_responses=True)
    for line in [*gateway_acl("web", GW_PW), *worker_acl(WK_PW)]:
        admin.execute_command(*line.split())
    llm = FakeLLM().start()
    host = server.url.removeprefix("redis://")
    worker_env = {
        "AGENT_PROVIDER": "openai",
        "AGENT_MODEL": "fake-model",
        "OPENAI_BASE_URL": llm.base_url,
        "OPENAI_API_KEY": "test",
        "AGENT_STREAM_DELTAS": "1",
    }
    procs = [
        WorkerProcess(f"redis://agent-worker:{WK_PW}@{host}", worker_id=f"gw-w{i}", env=worker_env)
        for i in range(workers)
    ]
    gws: list[GatewayProcess] = []
    st = Stack(server, admin, llm, gws, procs)
    st.worker_url, st.worker_env = f"redis://agent-worker:{WK_PW}@{host}", worker_env
    try:
        for i in range(gateways):
            gws.append(
                GatewayProcess(
                    f"redis://gateway-web:{GW_PW}@{host}",
                    name=f"gw{i}",
                    env={
                        "AGENT_GATEWAY_TOKENS": f"{ALICE_TOKEN}=alice,{BOB_TOKEN}=bob",
                        "AGENT_GATEWAY_KEEPALIVE_S": "1",
                        "AGENT_GATEWAY_TRUSTED_PROXIES": "10.9.9.9",  # a proxy that is not there
                        # the suite opens 80 streams at once as one user (a test of its own
                        # covers the rate: tests/test_gateway_ratelimit.py)
                        "AGENT_GATEWAY_USER_BURST": "1000",
                        **(gateway_env or {}),
                    },
                )
            )
        if failover_lb:
            st.lb = LoadBalancer([g.port for g in gws], failover=True)
        yield st
    finally:
        for proc in [*procs, *gws]:
            print(
                f"----- log of {getattr(proc, 'worker_id', '') or getattr(proc, 'name', '')} -----"
            )
            print(proc.log()[-3000:])
            proc.close()
        if st.lb is not None:
            st.lb.close()
        llm.stop()
        admin.close()
        server.cleanup()
