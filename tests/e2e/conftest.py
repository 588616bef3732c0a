from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from slogate.local_redis import LocalRedis
from slogate.processes import Stack

FAST_FLEET = {
    "SLOGATE_HEARTBEAT_INTERVAL_S": "0.2",
    "SLOGATE_HEARTBEAT_TTL_S": "1.0",
    "SLOGATE_WORKER_POLL_S": "0.1",
    "SLOGATE_CLAIM_IDLE_S": "1.0",
}
MODEL = "slogate-sim"


def start_stack(server: LocalRedis, decode_base_s: float, workers_per_pool: int = 1,
                **env: str) -> Stack:
    client = redis.Redis.from_url(server.url)
    client.flushdb()
    client.close()
    stack = Stack(server.url, {**FAST_FLEET, **env})
    stack.gateway()
    for pool in ("interactive", "batch"):
        for _ in range(workers_per_pool):
            stack.worker(pool, "sim", f"decode_base_s={decode_base_s}", "decode_s_per_seq=0",
                         "prefill_s_per_token=0")
    stack.wait_models(MODEL, pools=2)
    stack.wait_http("/readyz")
    return stack


@pytest.fixture(scope="module")
def stack(redis_server: LocalRedis) -> Iterator[Stack]:
    """Gateway + one fast sim worker per pool."""
    s = start_stack(redis_server, decode_base_s=0.001)
    yield s
    s.stop()
