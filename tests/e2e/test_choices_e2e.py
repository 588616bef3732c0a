"""``n`` choices: one request fanned out as ``n`` engine requests, their answers merged, through
a real gateway, Redis and sim workers (whose text depends on the prompt and the seed: without
one every choice says the same). What a failed or abandoned choice does is in ``test_failures``."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import openai
import pytest

from slogate.local_redis import LocalRedis
from slogate.processes import Stack, http_get
from tests.e2e.conftest import FAST_FLEET, MODEL
from tests.e2e.test_api import CHAT, sse_events
from tests.e2e.test_observability import audit_records


async def post(url: str, path: str, payload: dict, **headers: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.post(url + path, json=payload, headers=headers) as r:
        return r.status, await r.json()


async def streamed(url: str, path: str, payload: dict) -> list[dict | str]:
    async with aiohttp.ClientSession() as s, s.post(url + path, json={**payload, "stream": True}) as r:
        assert r.status == 200
        return await sse_events(r)


async def test_chat_n3_has_three_choices_each_with_its_own_answer_and_usage_summed(stack: Stack) -> None:
    _, one = await post(stack.url, "/v1/chat/completions", CHAT)
    status, three = await post(stack.url, "/v1/chat/completions", {**CHAT, "n": 3, "logprobs": True},
                               **{"x-request-id": "n3-chat"})
    assert status == 200, three
    assert [c["index"] for c in three["choices"]] == [0, 1, 2]
    for choice in three["choices"]:
        assert choice["message"] == one["choices"][0]["message"]
        assert choice["finish_reason"] == "length"
        assert len(choice["logprobs"]["content"]) == 6
    prompt = one["usage"]["prompt_tokens"]
    assert three["usage"] == {"prompt_tokens": prompt, "completion_tokens": 18, "total_tokens": prompt + 18}
    deadline = time.monotonic() + 5
    while "n3-chat" not in (records := audit_records(stack)) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    audited = records["n3-chat"]
    assert audited["id"] == three["id"] and audited["outcome"] == "length"
    assert (audited["prompt_tokens"], audited["completion_tokens"]) == (prompt, 18), "counted once, tokens summed"


async def test_completions_n3_not_streamed(stack: Stack) -> None:
    payload = {"model": MODEL, "prompt": "the risk of", "max_tokens": 4, "n": 3}
    status, body_ = await post(stack.url, "/v1/completions", payload)
    assert status == 200, body_
    assert [c["index"] for c in body_["choices"]] == [0, 1, 2]
    assert all(len(c["text"].split()) == 4 and c["finish_reason"] == "length" for c in body_["choices"])
    assert body_["usage"]["completion_tokens"] == 12
    assert body_["usage"]["total_tokens"] == body_["usage"]["prompt_tokens"] + 12


async def test_seeded_choices_say_different_things_and_the_same_again_with_the_same_seed(stack: Stack) -> None:
    payload = {"model": MODEL, "prompt": "the risk of", "max_tokens": 6, "n": 3, "seed": 7, "temperature": 0.8}
    answers = [await post(stack.url, "/v1/completions", payload) for _ in range(2)]
    assert all(status == 200 for status, _ in answers), answers
    first, again = ([c["text"] for c in body_["choices"]] for _, body_ in answers)
    assert len(set(first)) == 3, first
    assert again == first


def by_choice(chunks: list[dict], key: str) -> dict[int, str]:
    texts: dict[int, str] = {}
    for c in chunks:
        for choice in c["choices"]:
            part = choice["delta"].get("content") if key == "delta" else choice["text"]
            texts[choice["index"]] = texts.get(choice["index"], "") + (part or "")
    return texts


async def test_chat_n2_streamed_has_both_choices_their_finishes_one_usage_and_one_done(stack: Stack) -> None:
    _, one = await post(stack.url, "/v1/chat/completions", CHAT)
    events = await streamed(stack.url, "/v1/chat/completions",
                            {**CHAT, "n": 2, "stream_options": {"include_usage": True}})
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    chunks = [e for e in events if isinstance(e, dict)]
    assert not any("error" in c for c in chunks)
    assert all(len(c["choices"]) <= 1 for c in chunks), "a chunk carries one choice"
    roles = [c["choices"][0]["index"] for c in chunks if c["choices"] and c["choices"][0]["delta"].get("role")]
    assert sorted(roles) == [0, 1]
    finishes = [(c["choices"][0]["index"], c["choices"][0]["finish_reason"])
                for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert sorted(finishes) == [(0, "length"), (1, "length")]
    text = one["choices"][0]["message"]["content"]
    assert by_choice(chunks, "delta") == {0: text, 1: text}
    usage = chunks[-1]
    assert usage["choices"] == []
    prompt = one["usage"]["prompt_tokens"]
    assert usage["usage"] == {"prompt_tokens": prompt, "completion_tokens": 12, "total_tokens": prompt + 12}


async def test_completions_n2_streamed_with_log_probabilities_places_each_choices_tokens_in_its_own_text(
        stack: Stack) -> None:
    payload = {"model": MODEL, "prompt": "the risk of", "max_tokens": 4, "n": 2, "logprobs": 1}
    events = await streamed(stack.url, "/v1/completions", payload)
    chunks = [e for e in events if isinstance(e, dict)]
    offsets: dict[int, list[int]] = {0: [], 1: []}
    for c in chunks:
        for choice in c["choices"]:
            if choice["logprobs"]:
                offsets[choice["index"]] += choice["logprobs"]["text_offset"]
    texts = by_choice(chunks, "text")
    assert texts[0] == texts[1] and len(texts[0].split()) == 4
    assert offsets[0] == offsets[1] and offsets[0][0] == 0, "each choice's offsets are into its own text"
    assert sorted(c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]) == [0, 1]


def test_openai_sdk_n(stack: Stack) -> None:
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(model=MODEL, max_tokens=3, n=3,
                                          messages=[{"role": "user", "content": "score txn 3"}])
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert all(c.message.content and c.finish_reason == "length" for c in chat.choices)
    assert chat.usage.completion_tokens == 9
    done: dict[int, str] = {}
    texts: dict[int, str] = {0: "", 1: ""}
    for chunk in client.completions.create(model=MODEL, prompt="risk", max_tokens=3, n=2, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                done[choice.index] = choice.finish_reason
    assert done == {0: "length", 1: "length"} and texts[0] == texts[1] and len(texts[0].split()) == 3
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, max_tokens=3, n=9,
                                       messages=[{"role": "user", "content": "score txn 3"}])
    assert info.value.body["param"] == "n"


@pytest.fixture
def one_at_a_time(tmp_path: Path) -> Iterator[Stack]:
    """A gateway (admission off: it still learns the pools' costs) before sim workers that run one
    request at a time, 0.05 s a token."""
    server = LocalRedis(tmp_path / "redis").start()
    stack = Stack(server.url, {**FAST_FLEET, "SLOGATE_ADMISSION_CONTROL": "0"})
    try:
        stack.gateway()
        for pool in ("interactive", "batch"):
            stack.worker(pool, "sim", "decode_base_s=0.05", "decode_s_per_seq=0", "prefill_s_per_token=0",
                         "max_batch=1")
        stack.wait_models(MODEL, pools=2)
        stack.wait_http("/readyz")
        yield stack
    finally:
        stack.stop()
        server.stop()


def learned_decode_s(url: str, pool: str) -> float:
    _, text = http_get(url + "/metrics")
    pattern = rf'slogate_admission_learned_cost_seconds{{phase="decode_per_token",pool="{pool}"}} (\S+)'
    return float(re.search(pattern, text.decode()).group(1))


@pytest.mark.parametrize("stream", [False, True])
async def test_choices_that_wait_for_each_other_teach_admission_each_ones_own_cost(one_at_a_time: Stack,
                                                                                  stream: bool) -> None:
    """The second choice waits for the first's slot: the request's end is the second's, its first
    token the first's, and its tokens one choice's. As one sample that is a token every 0.1 s,
    twice the pool's cost, which would shed or misroute what comes after."""
    payload = {**CHAT, "max_tokens": 20, "ignore_eos": True, "n": 2, "stream": stream}
    tpot_before = tpot_totals(one_at_a_time.url)
    async with aiohttp.ClientSession() as s, s.post(one_at_a_time.url + "/v1/chat/completions", json=payload,
                                                    headers={"x-slogate-class": "interactive"}) as r:
        assert r.status == 200
        await r.read()
    decode_s = learned_decode_s(one_at_a_time.url, "interactive")
    assert 0.04 < decode_s < 0.065, decode_s
    total_s, count = (a - b for a, b in zip(tpot_totals(one_at_a_time.url), tpot_before))
    assert count == 2 and 0.04 < total_s / count < 0.065, "the time per token is each choice's own, too"


def tpot_totals(url: str) -> tuple[float, float]:
    """The time-per-output-token histogram's sum and count, over all its series."""
    text = http_get(url + "/metrics")[1].decode()
    sums = re.findall(r"^slogate_time_per_output_token_seconds_sum\{[^}]*\} (\S+)", text, re.M)
    counts = re.findall(r"^slogate_time_per_output_token_seconds_count\{[^}]*\} (\S+)", text, re.M)
    return sum(map(float, sums)), sum(map(float, counts))


def own_in_flight(url: str, pool: str) -> float:
    """The gateway's own engine requests in flight on ``pool``: what admission predicts waits from."""
    text = http_get(url + "/metrics")[1].decode()
    return float(re.search(rf'^slogate_pool_requests_in_flight{{pool="{pool}"}} (\S+)', text, re.M).group(1))


async def test_a_choice_that_finished_frees_its_slot_while_another_runs(one_at_a_time: Stack) -> None:
    """The worker runs one choice at a time: the second runs for 2 s after the first has finished.
    Held to the request's end, the first's slot would count as busy, with its predicted end, and
    admission would predict a wait for a slot nobody holds."""
    payload = {**CHAT, "max_tokens": 40, "ignore_eos": True, "n": 2, "stream": True}
    url = one_at_a_time.url
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/chat/completions", json=payload,
                                                    headers={"x-slogate-class": "interactive"}) as r:
        assert r.status == 200
        async for line in r.content:
            if line.startswith(b"data: {") and b'"finish_reason":"length"' in line.replace(b" ", b""):
                break
        in_flight_then = await asyncio.to_thread(own_in_flight, url, "interactive")
        await r.read()
    assert in_flight_then == 1, "the finished choice's slot is free while the other runs"
    assert await asyncio.to_thread(own_in_flight, url, "interactive") == 0
