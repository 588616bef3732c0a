"""The OpenAI surface, through a raw aiohttp client and through the official SDK."""

from __future__ import annotations

import asyncio
import json
import re

import aiohttp
import openai
import pytest
import redis

from slogate.processes import Stack
from tests.e2e.conftest import MODEL, start_stack

CHAT = {"model": MODEL, "messages": [{"role": "system", "content": "score it"},
                                     {"role": "user", "content": "txn 1: 10 EUR"}], "max_tokens": 6}


async def sse_events(resp: aiohttp.ClientResponse) -> list[dict | str]:
    events: list[dict | str] = []
    async for line in resp.content:
        line = line.strip()
        if not line:
            continue
        assert line.startswith(b"data: "), line
        data = line[len(b"data: "):]
        events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return events


async def test_chat_non_streamed(stack: Stack) -> None:
    async with aiohttp.ClientSession() as s, s.post(stack.url + "/v1/chat/completions", json=CHAT) as r:
        assert r.status == 200
        body = await r.json()
        assert r.headers["x-request-id"]
        assert r.headers["x-slogate-class"] == "interactive"
    assert body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert len(choice["message"]["content"].split()) == 6
    assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 6
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 6


async def test_text_response_format_and_empty_tools_are_accepted(stack: Stack) -> None:
    """What asks for nothing this gateway cannot do is served; a JSON format or tools are refused
    (``test_bad_input``)."""
    body = {**CHAT, "response_format": {"type": "text"}, "logit_bias": {}, "functions": [], "tool_choice": "none",
            "top_logprobs": 0, "modalities": ["text"], "metadata": {"team": "risk"}, "store": False,
            "parallel_tool_calls": False,
            "messages": [{"role": "assistant", "content": None}, *CHAT["messages"]]}
    async with aiohttp.ClientSession() as s, s.post(stack.url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200
        assert (await r.json())["usage"]["completion_tokens"] == 6


async def test_chat_streamed_matches_non_streamed(stack: Stack) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(stack.url + "/v1/chat/completions", json=CHAT) as r:
            full = (await r.json())["choices"][0]["message"]["content"]
        body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
        async with s.post(stack.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            events = await sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if isinstance(e, dict)]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [f["choices"][0]["finish_reason"] for f in finals] == ["length"]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == full
    content_chunks = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert len(content_chunks) == 6


async def test_continuous_usage_counts_each_chunks_tokens(stack: Stack) -> None:
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    async with aiohttp.ClientSession() as s, s.post(stack.url + "/v1/chat/completions", json=body) as r:
        events = await sse_events(r)
    content = [e for e in events if isinstance(e, dict) and e["choices"] and e["choices"][0]["delta"].get("content")]
    assert [c["usage"]["completion_tokens"] for c in content] == [1, 2, 3, 4, 5, 6]
    assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]
               for c in content)
    body["stream_options"] = {"include_usage": False, "continuous_usage_stats": True}
    async with aiohttp.ClientSession() as s, s.post(stack.url + "/v1/chat/completions", json=body) as r:
        events = await sse_events(r)
    assert not any("usage" in e for e in events if isinstance(e, dict))


async def test_completions_streamed_and_not(stack: Stack) -> None:
    body = {"model": MODEL, "prompt": "the risk of", "max_tokens": 4}
    async with aiohttp.ClientSession() as s:
        async with s.post(stack.url + "/v1/completions", json=body) as r:
            assert r.status == 200
            full = await r.json()
        async with s.post(stack.url + "/v1/completions", json={**body, "stream": True}) as r:
            events = await sse_events(r)
    assert full["object"] == "text_completion"
    text = full["choices"][0]["text"]
    assert full["usage"]["completion_tokens"] == 4
    chunks = [e for e in events if isinstance(e, dict)]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_stop_string_is_honoured(stack: Stack) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(stack.url + "/v1/completions",
                          json={"model": MODEL, "prompt": "p", "max_tokens": 12}) as r:
            words = (await r.json())["choices"][0]["text"].split()
        stop = f" {words[3]}"
        async with s.post(stack.url + "/v1/completions",
                          json={"model": MODEL, "prompt": "p", "max_tokens": 12, "stop": stop}) as r:
            body = await r.json()
    cut = " " + " ".join(words)
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["text"] == cut[:cut.index(stop)]


async def test_without_max_tokens_a_prompt_near_the_context_gets_what_room_is_left(stack: Stack) -> None:
    """The default max_tokens (256) is a cap, not a demand: a prompt of 8,000 of the sim's
    8,192 tokens that sets no limit gets the 192 left, where one that asks for 256 is refused."""
    body = {"model": MODEL, "prompt": "x" * 32_000}
    async with aiohttp.ClientSession() as s:
        async with s.post(stack.url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            fitted = await r.json()
        async with s.post(stack.url + "/v1/completions", json={**body, "max_tokens": 256}) as r:
            assert r.status == 400
            assert (await r.json())["error"]["code"] == "context_length_exceeded"
    assert fitted["usage"] == {"prompt_tokens": 8000, "completion_tokens": 192, "total_tokens": 8192}
    assert fitted["choices"][0]["finish_reason"] == "length"


def test_openai_sdk_chat_and_completions(stack: Stack) -> None:
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused")
    models = [m.id for m in client.models.list()]
    assert MODEL in models
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("org/no-such-model")
    assert missing.value.body["code"] == "model_not_found" and "org/no-such-model" in missing.value.message
    chat = client.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=5)
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage is not None and chat.usage.completion_tokens == 5
    stream = client.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=5,
                                            stream=True, stream_options={"include_usage": True})
    parts, usage = [], None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
    assert "".join(parts) == chat.choices[0].message.content
    assert usage is not None and usage.completion_tokens == 5
    comp = client.completions.create(model=MODEL, prompt="hello", max_tokens=3)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="hello", max_tokens=3, stream=True) if c.choices)
    assert streamed == comp.choices[0].text and len(streamed.split()) == 3


def test_openai_sdk_log_probabilities_chat_and_completions(stack: Stack) -> None:
    """One entry a token sampled, streamed or not, each with the likeliest tokens asked for; a
    token that completed a stop string has its entry though its text is cut."""
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=5,
                                          logprobs=True, top_logprobs=2)
    entries = chat.choices[0].logprobs.content
    assert len(entries) == chat.usage.completion_tokens == 5
    assert "".join(e.token for e in entries) == chat.choices[0].message.content
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token for e in entries)
    assert all(bytes(e.bytes) == e.token.encode() and e.logprob <= 0 for e in entries)
    streamed = [e for c in client.chat.completions.create(
        model=MODEL, messages=CHAT["messages"], max_tokens=5, logprobs=True, top_logprobs=2, stream=True)
        if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in entries]
    assert client.chat.completions.create(model=MODEL, messages=CHAT["messages"],
                                          max_tokens=5).choices[0].logprobs is None

    comp = client.completions.create(model=MODEL, prompt="hello", max_tokens=8, logprobs=1)
    lp = comp.choices[0].logprobs
    assert "".join(lp.tokens) == comp.choices[0].text and len(lp.token_logprobs) == 8
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    assert all(list(top) == [token] for top, token in zip(lp.top_logprobs, lp.tokens))
    stop = lp.tokens[3]
    cut = client.completions.create(model=MODEL, prompt="hello", max_tokens=8, logprobs=0, stop=stop)
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == "".join(lp.tokens[:3])
    assert cut.choices[0].logprobs.tokens == lp.tokens[:4] and cut.usage.completion_tokens == 4
    streamed_cut = [t for c in client.completions.create(model=MODEL, prompt="hello", max_tokens=8, logprobs=0,
                                                         stop=stop, stream=True)
                    if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed_cut == lp.tokens[:4]


def test_openai_sdk_surfaces_errors(stack: Stack) -> None:
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=CHAT["messages"])
    assert "no-such-model" in str(info.value)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=CHAT["messages"], temperature=5)
    assert "temperature" in str(info.value)


async def test_request_id_is_echoed(stack: Stack) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(stack.url + "/v1/chat/completions", json=CHAT,
                          headers={"x-request-id": "client-abc-1"}) as r:
            assert r.headers["x-request-id"] == "client-abc-1"
        async with s.get(stack.url + "/v1/nothing-here", headers={"x-request-id": "client-abc-2"}) as r:
            assert r.status == 404 and r.headers["x-request-id"] == "client-abc-2"


async def test_health_ready_models_metrics(stack: Stack) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.get(stack.url + "/healthz") as r:
            assert r.status == 200
        async with s.get(stack.url + "/readyz") as r:
            assert r.status == 200
        async with s.get(stack.url + "/v1/models") as r:
            data = (await r.json())["data"]
        assert data[0]["id"] == MODEL and sorted(data[0]["pools"]) == ["batch", "interactive"]
        async with s.post(stack.url + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 200
        async with s.get(stack.url + "/metrics") as r:
            text = await r.text()
        async with s.get(stack.url + "/openapi.json") as r:
            doc = await r.json()
    assert "/v1/chat/completions" in doc["paths"]
    assert 'slogate_requests_total{class="interactive",model="slogate-sim",outcome="length",pool="interactive"}' in text
    assert "slogate_e2e_request_latency_seconds_bucket" in text
    assert 'le="0.15"' in text
    assert 'slogate_live_workers{pool="batch"} 1.0' in text


async def test_class_header_routes_to_batch_pool(stack: Stack) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(stack.url + "/v1/chat/completions", json=CHAT,
                          headers={"x-slogate-class": "batch"}) as r:
            assert r.status == 200
            assert r.headers["x-slogate-class"] == "batch"
            assert r.headers["x-slogate-pool"] == "batch"


async def test_finished_requests_leave_no_keys(stack: Stack) -> None:
    async with aiohttp.ClientSession() as s:
        for stream in (False, True):
            for _ in range(5):
                async with s.post(stack.url + "/v1/chat/completions", json={**CHAT, "stream": stream}) as r:
                    await r.read()
    await asyncio.sleep(2.2)  # the gateway trims what it has read once a second, idle or not
    client = redis.Redis.from_url(stack.redis_url)
    names = {k.decode() for k in client.scan_iter("*")}
    per_gateway = ("slogate:r:", "slogate:alive:")
    shared = ("slogate:q:", "slogate:hb:", "slogate:workers", "slogate:audit", "slogate:prompt_ratios")
    per_request = {k for k in names if not k.startswith((*shared, *per_gateway))}
    replies = [k for k in names if k.startswith("slogate:r:")]
    queues = {p: client.xlen(f"slogate:q:{p}") for p in ("interactive", "batch")}
    pending = {p: client.xpending(f"slogate:q:{p}", "workers")["pending"] for p in queues}
    reply_len = client.xlen(replies[0])
    client.close()
    assert per_request == set(), "no key may outlive the request that made it"
    assert len(replies) == 1, "one reply stream per gateway, none per request"
    assert sum(k.startswith("slogate:alive:") for k in names) == 1, "one liveness key per gateway"
    assert reply_len <= 1, "read results are trimmed away"
    assert queues == {"interactive": 0, "batch": 0}
    assert pending == {"interactive": 0, "batch": 0}


async def test_a_quiet_stream_sends_keep_alive_comments(own_redis) -> None:
    """Steps of 1.5 s: before each token the stream sends SSE comments, which the SDK skips. On
    a Redis of its own: the module's fast workers would take its requests from a shared queue."""
    slow = start_stack(own_redis, decode_base_s=1.5, SLOGATE_SSE_KEEP_ALIVE_S="0.3",
                       SLOGATE_ADMISSION_CONTROL="0")
    try:
        body = {**CHAT, "max_tokens": 2, "stream": True}
        async with aiohttp.ClientSession() as s, s.post(slow.url + "/v1/chat/completions", json=body) as r:
            lines = [line.strip() async for line in r.content if line.strip()]
        comments = [i for i, line in enumerate(lines) if line == b": keep-alive"]
        texts = [i for i, line in enumerate(lines) if re.search(rb'"content":"[^"]', line)]
        assert len(texts) == 2 and comments and comments[0] < texts[0], lines
        assert lines[-1] == b"data: [DONE]"
        client = openai.OpenAI(base_url=slow.url + "/v1", api_key="x", max_retries=0)
        chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=1,
                                                     stream=True))
        assert sum(bool(c.choices and c.choices[0].delta.content) for c in chunks) == 1
    finally:
        slow.stop()
