from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


def streamed_calls(chunks: list[Any]) -> dict[int, list[dict[str, str]]]:
    """Each choice's calls, as a client adds up the SDK's chunks: the first of a call carries its
    id and name, with empty arguments, the rest more of the arguments."""
    out: dict[int, list[dict[str, str]]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or ():
                calls = out.setdefault(choice.index, [])
                if delta.id is not None:
                    assert delta.index == len(calls) and delta.function.arguments == "" and delta.type == "function"
                    calls.append({"id": delta.id, "name": delta.function.name, "arguments": ""})
                else:
                    calls[delta.index]["arguments"] += delta.function.arguments
    return out


def _flush(server: LocalRedis) -> None:
    client = redis.Redis.from_url(server.url)
    client.flushdb()
    client.close()


def start_stack(server: LocalRedis, decode_base_s: float, workers_per_pool: int = 1,
                **env: str) -> Stack:
    _flush(server)
    stack = Stack(server.url, {**FAST_FLEET, **env})
    stack.gateway()
    for pool in ("interactive", "batch"):
        for _ in range(workers_per_pool):
            stack.worker(pool, "sim", f"decode_base_s={decode_base_s}", "decode_s_per_seq=0",
                         "prefill_s_per_token=0")
    stack.wait_models(MODEL, pools=2)
    stack.wait_http("/readyz")
    return stack


def start_engines(server: LocalRedis, model_dir: Path, *workers: tuple[str, ...]) -> Stack:
    """Gateway + a worker for each ``(pool, engine, *options)``, serving the model in
    ``model_dir`` in fp32, admission control off; ready once each pool serves it."""
    _flush(server)
    stack = Stack(server.url, {**FAST_FLEET, "SLOGATE_MODEL": str(model_dir), "SLOGATE_ADMISSION_CONTROL": "0"})
    stack.gateway()
    for pool, engine, *options in workers:
        stack.worker(pool, engine, "dtype=\"fp32\"", *options)
    stack.wait_models(model_dir.name, pools=len(workers), timeout=120)
    return stack


@pytest.fixture(scope="module")
def stack(redis_server: LocalRedis) -> Iterator[Stack]:
    """Gateway + one fast sim worker per pool."""
    s = start_stack(redis_server, decode_base_s=0.001)
    yield s
    s.stop()
