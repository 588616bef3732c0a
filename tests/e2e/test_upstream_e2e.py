"""The upstream engine: a gateway whose workers forward to another OpenAI-compatible server.

The server here is a second slogate stack of its own Redis (gateway + sim workers), reached
over HTTP as any vLLM or TGI server would be; the front stack serves the same model under
another name, so what reaches the client has crossed both gateways and both Redis servers.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import openai
import pytest

from engines.base import EngineRequest, StepOutput
from engines.upstream import UpstreamEngine, create
from gateway.auth import hash_key
from slogate.local_redis import LocalRedis
from slogate.processes import Stack, http_get
from slogate.protocol import SamplingParams
from tests.e2e.conftest import FAST_FLEET, MODEL, _flush

FRONT = "risk-front"
KEY = "sk-front-worker"


@pytest.fixture(scope="module")
def upstream(redis_server: LocalRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The server behind, which wants an API key: sim tokens at 5 ms each, so that a stream can
    be cut halfway."""
    config = tmp_path_factory.mktemp("upstream-cfg") / "slogate.yaml"
    config.write_text(f"api_keys:\n  - {{id: front, sha256: {hash_key(KEY)}}}\n")
    _flush(redis_server)
    s = Stack(redis_server.url, {**FAST_FLEET, "SLOGATE_CONFIG": str(config)})
    try:
        s.gateway()
        for pool in ("interactive", "batch"):
            s.worker(pool, "sim", "decode_base_s=0.005", "decode_s_per_seq=0", "prefill_s_per_token=0")
        s.wait_models(MODEL, pools=2, api_key=KEY)
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def front(upstream: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    own = LocalRedis(tmp_path_factory.mktemp("front-redis")).start()
    _flush(own)
    s = Stack(own.url, {**FAST_FLEET, "SLOGATE_MODEL": FRONT, "SLOGATE_DEFAULT_MAX_TOKENS": "20", "UPSTREAM_KEY": KEY})
    try:
        s.gateway()
        for pool in ("interactive", "batch"):
            s.worker(pool, "upstream", f"url={upstream.url}/v1", f"upstream_model={MODEL}", "api_key_env=UPSTREAM_KEY")
        s.wait_models(FRONT, pools=2)
        yield s
    finally:
        s.stop()
        own.stop()


def client(stack: Stack, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0)


def test_models_lists_the_servers_context(front: Stack) -> None:
    listed = {m["id"]: m for m in json.loads(http_get(front.url + "/v1/models")[1])["data"]}
    assert listed[FRONT]["max_model_len"] == 8192  # the sim engine's, as the server behind lists it


def test_chat_answer_is_the_servers(front: Stack, upstream: Stack) -> None:
    ask = {"max_tokens": 7, "temperature": 0, "stop": [" hold"],
           "messages": [{"role": "user", "content": "score txn 4: 250 EUR, new device"}]}
    there = client(upstream, KEY).chat.completions.create(model=MODEL, **ask)
    here = client(front).chat.completions.create(model=FRONT, **ask)
    assert here.model == FRONT
    assert here.choices[0].message.content == there.choices[0].message.content
    assert here.choices[0].finish_reason == there.choices[0].finish_reason
    assert here.usage.prompt_tokens == there.usage.prompt_tokens
    assert here.usage.completion_tokens == there.usage.completion_tokens


def test_streamed_completion_adds_up_to_the_answer(front: Stack) -> None:
    ask = {"model": FRONT, "prompt": "Risk report for account 7:", "max_tokens": 12, "temperature": 0}
    whole = client(front).completions.create(**ask)
    chunks = list(client(front).completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    assert len(texts) == 12  # one chunk a token, as the server sent them
    assert "".join(texts) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_the_gateways_default_cap_holds_without_the_server_being_told_it(front: Stack, upstream: Stack) -> None:
    ask = {"prompt": "Quarterly exposure report:", "temperature": 0}
    here = client(front).completions.create(model=FRONT, **ask)
    there = client(upstream, KEY).completions.create(model=MODEL, max_tokens=20, **ask)
    assert here.choices[0].finish_reason == "length" and here.usage.completion_tokens == 20
    assert here.choices[0].text == there.choices[0].text


def test_logprobs_pass_through(front: Stack) -> None:
    answer = client(front).chat.completions.create(
        model=FRONT, max_tokens=3, logprobs=True, top_logprobs=2,
        messages=[{"role": "user", "content": "score txn 9"}])
    entries = answer.choices[0].logprobs.content
    assert len(entries) == 3
    assert "".join(e.token for e in entries) == answer.choices[0].message.content
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token for e in entries)


def test_the_servers_refusal_reaches_the_client(front: Stack) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client(front).chat.completions.create(
            model=FRONT, max_tokens=5, response_format={"type": "json_object"},
            messages=[{"role": "user", "content": "score txn 2"}])
    assert "response_format" in refused.value.message  # the sim engine behind cannot hold JSON


def test_tools_are_refused_not_answered_wrongly(front: Stack) -> None:
    tool = {"type": "function", "function": {"name": "score", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError) as refused:
        client(front).chat.completions.create(model=FRONT, max_tokens=5, tools=[tool],
                                              messages=[{"role": "user", "content": "score txn 3"}])
    assert "upstream engine does not pass tools on" in refused.value.message


def _cancelled(stack: Stack) -> float:
    total = 0.0
    for line in http_get(stack.url + "/metrics")[1].decode().splitlines():
        if line.startswith("slogate_requests_total{") and 'outcome="cancelled"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_client_gone_stops_the_servers_work(front: Stack, upstream: Stack) -> None:
    before = _cancelled(upstream)
    stream = client(front).completions.create(model=FRONT, prompt="long report", max_tokens=2000, stream=True)
    for _, _ in zip(range(3), stream):
        pass
    stream.close()
    deadline = time.monotonic() + 10
    while _cancelled(upstream) <= before:
        assert time.monotonic() < deadline, "the server behind went on generating for a client that left"
        time.sleep(0.05)


def test_a_server_that_is_not_there_stops_the_worker_at_start(upstream: Stack) -> None:
    with pytest.raises(ValueError, match="cannot read http://127.0.0.1:9/v1/models"):
        create(FRONT, url="http://127.0.0.1:9/v1", connect_timeout_s=1.0)
    with pytest.raises(ValueError, match="url=http"):
        create(FRONT)
    with pytest.raises(ValueError, match="api_key_env names SLOGATE_TEST_NO_SUCH_KEY, which is not set"):
        create(FRONT, url=f"{upstream.url}/v1", api_key_env="SLOGATE_TEST_NO_SUCH_KEY")


def _run_one(engine: UpstreamEngine, request: EngineRequest) -> StepOutput:
    engine.add_request(request)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for out in engine.step():
            if out.finish_reason is not None or out.error is not None:
                return out
    raise AssertionError("no answer within 10 s")


def test_a_wrong_key_model_or_url_or_a_server_gone_is_the_gateways_502(upstream: Stack) -> None:
    ask = EngineRequest("r1", SamplingParams(max_tokens=3), time.time() + 30, prompt="score")
    url = f"{upstream.url}/v1"
    wrong_key = create(FRONT, url=url, upstream_model=MODEL, max_context=100, api_key="sk-wrong")
    out = _run_one(wrong_key, ask)
    assert out.error_status == 502 and "credentials" in out.error
    wrong_model = create(FRONT, url=url, upstream_model="no-such-model", max_context=100, api_key=KEY)
    out = _run_one(wrong_model, ask)
    assert out.error_status == 502 and "no-such-model" in out.error
    wrong_url = create(FRONT, url=upstream.url, upstream_model=MODEL, max_context=100, api_key=KEY)  # no /v1
    out = _run_one(wrong_url, ask)
    assert out.error_status == 502 and out.error_code == "upstream_error"
    gone = create(FRONT, url="http://127.0.0.1:9/v1", max_context=100, connect_timeout_s=1.0)
    out = _run_one(gone, ask)
    assert out.error_status == 502 and "127.0.0.1" not in out.error, "the server's address stays in the worker's log"
    right = create(FRONT, url=url, upstream_model=MODEL, api_key=KEY)
    out = _run_one(right, ask)
    assert out.finish_reason == "length" and out.completion_tokens == 3
