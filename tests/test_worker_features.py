"""A request that needs a parameter an older worker ignores is refused while such a worker
serves its model, rather than answered as if the parameter had not been sent."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis
from aiohttp.test_utils import TestClient, TestServer

from gateway.app import make_app
from gateway.state import STATE
from slogate import keys, protocol
from slogate.config import Config
from slogate.protocol import Heartbeat, ModelInfo


async def _beat(r: aioredis.Redis, worker_id: str, features: list[str] | None, model: str = "m") -> None:
    hb = Heartbeat(worker_id=worker_id, pool="interactive", engine="sim", models=[ModelInfo(model, 8192)],
                   running=0, waiting=0, capacity=8, features=features)
    name = keys.heartbeat("interactive", worker_id)
    await r.set(name, protocol.encode(hb), px=60_000)
    await r.sadd(keys.WORKERS, name)


@pytest.mark.parametrize(("extra", "param"), [
    ({"logprobs": True, "top_logprobs": 2}, "logprobs"),
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}, "tools"),
])
async def test_a_parameter_an_older_worker_would_ignore_is_refused_until_it_is_upgraded(
        redis_url: str, extra: dict, param: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    try:
        await _beat(r, "new", list(protocol.FEATURES))
        await _beat(r, "old", None)
        await _beat(r, "other-model", None, model="other")
        cfg = Config(redis_url=redis_url, admission_control=False, worker_poll_s=0.05)
        async with TestClient(TestServer(make_app(cfg))) as client:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            headers = {"x-slogate-class": "interactive", "x-slogate-timeout": "0.3"}
            resp = await client.post("/v1/chat/completions", headers=headers, json={**body, **extra})
            err = (await resp.json())["error"]
            assert resp.status == 503, err
            assert err["code"] == "worker_outdated" and err["param"] == param
            assert param in err["message"] and "interactive/old" in err["message"]
            assert "other-model" not in err["message"], "a worker of another model is no reason to refuse"
            assert "Retry-After" in resp.headers

            plain = await client.post("/v1/chat/completions", headers=headers, json=body)
            assert plain.status == 504, "a request needing nothing new goes on, and times out unserved here"

            await r.delete(keys.heartbeat("interactive", "old"))
            await r.srem(keys.WORKERS, keys.heartbeat("interactive", "old"))
            await client.server.app[STATE].directory.refresh()
            upgraded = await client.post("/v1/chat/completions", headers=headers, json={**body, **extra})
            assert upgraded.status == 504, await upgraded.text()
    finally:
        await r.aclose()
