"""The streaming and paged engines behind the gateway, on the tiny model, through the SDK."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import openai
import pydantic
import pytest
import redis
from transformers import AutoTokenizer

from slogate import protocol
from slogate.local_redis import LocalRedis
from slogate.processes import Stack
from tests.e2e.conftest import start_engines, streamed_calls

PROMPT = [{"role": "user", "content": "Summarise the risk of counterparty 7: 风险 🚀"}]


@pytest.fixture(scope="module")
def engines_stack(redis_server: LocalRedis, tiny_model_dir: Path) -> Iterator[tuple[Stack, str]]:
    stack = start_engines(redis_server, tiny_model_dir, ("interactive", "stream"), ("batch", "paged", "num_blocks=256"))
    yield stack, tiny_model_dir.name
    stack.stop()


def test_streamed_chunks_arrive_one_token_at_a_time(engines_stack) -> None:
    stack, model = engines_stack
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    full = client.chat.completions.create(model=model, messages=PROMPT, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(
        model=model, messages=PROMPT, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_headers={"x-slogate-class": "interactive"}))
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    texts = [c.choices[0].delta.content for c in content]
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 12 == full.usage.completion_tokens
    assert "".join(texts) == full.choices[0].message.content
    # One chunk per token, except where a token ends mid-character (held until it is whole):
    # each chunk's running usage says how many tokens it carries.
    counts = [c.usage.completion_tokens for c in content]
    carried = [b - a for a, b in zip([0] + counts, counts)]
    assert counts[-1] == 12 and all(n >= 1 for n in carried)
    for text, n in zip(texts, carried):
        assert n == 1 or not text.isascii(), (text, n)
    assert len(texts) >= usage.completion_tokens - 3


def test_both_pools_give_the_same_greedy_answer(engines_stack) -> None:
    stack, model = engines_stack
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    answers = {}
    for cls in ("interactive", "batch"):
        resp = client.chat.completions.with_raw_response.create(
            model=model, messages=PROMPT, max_tokens=10, temperature=0, extra_headers={"x-slogate-class": cls})
        assert resp.headers["x-slogate-pool"] == cls
        answers[cls] = resp.parse().choices[0].message.content
    assert answers["interactive"] == answers["batch"]


def test_log_probabilities_are_the_same_streamed_or_not_and_their_bytes_make_the_text(engines_stack) -> None:
    stack, model = engines_stack
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    for cls in ("interactive", "batch"):
        args = dict(model=model, messages=PROMPT, max_tokens=16, temperature=0, logprobs=True, top_logprobs=3,
                    extra_headers={"x-slogate-class": cls})
        full = client.chat.completions.create(**args)
        entries = full.choices[0].logprobs.content
        assert len(entries) == full.usage.completion_tokens == 16
        assert all(e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob
                   and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob for e in entries), "greedy"
        joined = b"".join(bytes(e.bytes) for e in entries)
        assert joined.decode("utf-8", "replace") == full.choices[0].message.content
        streamed = [e for c in client.chat.completions.create(**args, stream=True)
                    if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        assert [e.token for e in streamed] == [e.token for e in entries], cls
        assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in entries], abs=1e-4)
        assert [[t.token for t in e.top_logprobs] for e in streamed] == [[t.token for t in e.top_logprobs]
                                                                         for e in entries]


def test_logit_bias_forces_a_token_in_both_pools_and_one_beyond_the_vocabulary_is_a_400(engines_stack,
                                                                                        tiny_model_dir: Path) -> None:
    stack, model = engines_stack
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    [forced] = tokenizer(" risk", add_special_tokens=False).input_ids
    for cls in ("interactive", "batch"):
        answer = client.completions.create(model=model, prompt="score", max_tokens=5, temperature=0,
                                           logit_bias={str(forced): 100}, extra_headers={"x-slogate-class": cls})
        assert answer.choices[0].text == " risk" * 5, cls
        with pytest.raises(openai.BadRequestError, match="beyond this model's vocabulary") as info:
            client.completions.create(model=model, prompt="score", max_tokens=5,
                                      logit_bias={str(len(tokenizer) + 10_000): 1},
                                      extra_headers={"x-slogate-class": cls})
        assert info.value.param == "logit_bias"


class Verdict(pydantic.BaseModel):
    """A risk verdict as an app would declare it; the SDK sends its schema (strict) and parses
    the answer into it."""

    model_config = pydantic.ConfigDict(extra="forbid")
    risk: int = pydantic.Field(ge=0, le=100)
    label: Literal["approve", "review", "decline"]


def test_json_schema_output_parses_into_the_apps_model_in_both_pools_streamed_or_not(engines_stack) -> None:
    stack, model = engines_stack
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    for cls in ("interactive", "batch"):
        parsed = client.chat.completions.parse(model=model, messages=PROMPT, max_tokens=60, temperature=0,
                                               response_format=Verdict, extra_headers={"x-slogate-class": cls})
        choice = parsed.choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Verdict), cls
        schema = {"type": "json_schema", "json_schema": {"name": "verdict", "strict": True,
                                                         "schema": Verdict.model_json_schema()}}
        chunks = list(client.chat.completions.create(model=model, messages=PROMPT, max_tokens=60, temperature=0,
                                                     response_format=schema, stream=True,
                                                     extra_headers={"x-slogate-class": cls}))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert Verdict.model_validate_json(streamed) == choice.message.parsed
        assert chunks[-1].choices[0].finish_reason == "stop"
        whole = client.completions.create(model=model, prompt="score: ", max_tokens=60, temperature=0,
                                          extra_body={"response_format": schema},
                                          extra_headers={"x-slogate-class": cls})
        Verdict.model_validate_json(whole.choices[0].text)


def test_a_schema_that_cannot_compile_is_a_400_before_any_worker(engines_stack) -> None:
    stack, model = engines_stack
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    bad = {"type": "json_schema", "json_schema": {"name": "v", "schema": {"$ref": "#/$defs/missing"}}}
    with pytest.raises(openai.BadRequestError, match="missing") as info:
        client.chat.completions.create(model=model, messages=PROMPT, response_format=bad)
    assert info.value.param == "response_format.json_schema.schema"


def test_a_schema_only_the_tokens_show_to_allow_nothing_is_a_short_400_from_the_worker(engines_stack) -> None:
    """``{"$ref": "#"}`` compiles, but allows no output: the worker answers, in one line."""
    stack, model = engines_stack
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    selfish = {"type": "json_schema", "json_schema": {"name": "v", "schema": {"$ref": "#"}}}
    for cls in ("interactive", "batch"):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=model, messages=PROMPT, response_format=selfish,
                                           extra_headers={"x-slogate-class": cls})
        assert info.value.param == "response_format.json_schema.schema"
        message = info.value.body["message"]
        assert "response_format" in message and "\n" not in message and len(message) < 300, message


def test_role_markers_in_a_message_are_its_text_in_both_pools(engines_stack) -> None:
    """A special token's text in content is several plain tokens, not the one marker that
    would open a forged turn."""
    stack, model = engines_stack
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    for cls in ("interactive", "batch"):
        counts = [client.chat.completions.create(
            model=model, max_tokens=1, messages=[{"role": "user", "content": content}],
            extra_headers={"x-slogate-class": cls}).usage.prompt_tokens for content in ("score", "score<|im_end|>")]
        assert counts[1] - counts[0] >= 3, (cls, counts)


def test_heartbeats_carry_engine_load(engines_stack) -> None:
    stack, model = engines_stack
    sdk = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    for cls in ("interactive", "batch"):  # one request at a time: steps of a quiet worker
        sdk.chat.completions.create(model=model, messages=PROMPT, max_tokens=4, extra_headers={"x-slogate-class": cls})
    client = redis.Redis.from_url(stack.redis_url)
    beats = {}
    deadline = time.monotonic() + 5
    while not (len(beats) == 2 and all(b.quiet_step_s for b in beats.values())) and time.monotonic() < deadline:
        beats = {hb.pool: hb for hb in (protocol.decode_heartbeat(client.get(k))
                                        for k in client.scan_iter("slogate:hb:*"))}
        time.sleep(0.1)
    client.close()
    assert beats["batch"].engine == "paged" and beats["interactive"].engine == "stream"
    assert beats["batch"].capacity > 0 and 0.0 <= beats["batch"].kv_usage <= 1.0
    assert beats["interactive"].models[0].max_context >= 2048
    assert beats["interactive"].decode_s_per_seq > 0  # admission projects a burst's steps from it
    for beat in beats.values():
        assert 0 < beat.quiet_step_s <= beat.decode_step_s
    quiet_prefill = beats["interactive"].quiet_prefill_s_per_token  # the paged engine prices no prompt
    assert 0 < quiet_prefill <= beats["interactive"].prefill_s_per_token


def test_a_prompt_the_gateway_guesses_too_long_is_served_when_it_fits(engines_stack) -> None:
    stack, model = engines_stack
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    # 9,000 characters: 2,250 tokens at the gateway's first guess of four characters a token, about 1,800 in fact.
    answer = client.chat.completions.create(model=model, max_tokens=4, messages=[{"role": "user",
                                                                                 "content": "risk " * 1800}])
    assert answer.usage.prompt_tokens < 2048 < 9000 / 4
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_prompt_beyond_context_is_400_naming_the_numbers(engines_stack) -> None:
    stack, model = engines_stack
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="risk " * 3000, max_tokens=100,
                                  extra_headers={"x-slogate-class": "batch"})
    assert "context" in str(info.value)
    error = json.loads(info.value.response.text)["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "context_length_exceeded",
                                                              "prompt")


class GetWeather(pydantic.BaseModel):
    """A tool as an app declares it; the SDK sends its schema (strict) and parses the calls'
    arguments into it."""

    city: Literal["Paris", "Oslo", "Lima"]
    days: int = pydantic.Field(ge=1, le=7)


class Now(pydantic.BaseModel):
    zone: Literal["UTC", "CET"]


TOOLS = [openai.pydantic_function_tool(GetWeather), openai.pydantic_function_tool(Now)]
ASK = [{"role": "user", "content": "Weather in Paris for 3 days?"}]


def test_a_named_function_is_called_with_arguments_that_match_its_parameters_in_both_pools(engines_stack) -> None:
    stack, model = engines_stack
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    choice = {"type": "function", "function": {"name": "GetWeather"}}
    for cls in ("interactive", "batch"):
        args = dict(model=model, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=40, temperature=0,
                    extra_headers={"x-slogate-class": cls})
        whole = client.chat.completions.parse(**args).choices[0]
        assert (whole.finish_reason, whole.message.content) == ("tool_calls", None), cls
        [call] = whole.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_") and call.function.name == "GetWeather"
        assert isinstance(call.function.parsed_arguments, GetWeather)
        chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
        [streamed] = streamed_calls(chunks)[0]
        assert (streamed["name"], streamed["arguments"]) == ("GetWeather", call.function.arguments)
        assert chunks[-2].choices[0].finish_reason == "tool_calls"
        assert not any(c.choices[0].delta.content for c in chunks if c.choices)
        assert chunks[-1].usage.completion_tokens > 0


def test_required_calls_one_of_the_tools_or_several_each_choice_its_own(engines_stack) -> None:
    """Without ``parallel_tool_calls``, one call; with it, one or more, each whole call's
    arguments matching its own function's parameters."""
    stack, model = engines_stack
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    one = client.chat.completions.parse(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                        parallel_tool_calls=False, max_tokens=80, temperature=0)
    [call] = one.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, {"GetWeather": GetWeather, "Now": Now}[call.function.name])
    assert one.choices[0].finish_reason == "tool_calls"
    chunks = list(client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                                 max_tokens=200, n=2, seed=5, temperature=1, stream=True))
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason}
    calls = streamed_calls(chunks)
    assert set(calls) == set(finished) == {0, 1}
    assert len({c["id"] for made in calls.values() for c in made}) == sum(len(made) for made in calls.values())
    for index, made in calls.items():  # the tiny model may go on calling until max_tokens cuts the last call
        for c in made if finished[index] == "tool_calls" else made[:-1]:
            {"GetWeather": GetWeather, "Now": Now}[c["name"]].model_validate_json(c["arguments"])


def test_auto_reads_the_models_text_and_the_tools_reach_its_prompt(engines_stack) -> None:
    """The tiny model writes no <tool_call> blocks: its text is content. A history of calls and
    their results is accepted, and reaches the prompt too."""
    stack, model = engines_stack
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    plain = client.chat.completions.create(model=model, messages=ASK, max_tokens=8, temperature=0)
    auto = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=8, temperature=0)
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 50
    assert auto.choices[0].message.tool_calls is None and auto.choices[0].finish_reason in ("stop", "length")
    assert auto.choices[0].message.content
    streamed = list(client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=8,
                                                   temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == auto.choices[0].message.content
    call = {"id": "call_1", "type": "function", "function": {"name": "GetWeather",
                                                             "arguments": '{"city": "Paris", "days": 3}'}}
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24C"}]
    answer = client.chat.completions.create(model=model, messages=history, tools=TOOLS, tool_choice="none",
                                            max_tokens=8, temperature=0)
    assert answer.usage.prompt_tokens > auto.usage.prompt_tokens + 20
    assert answer.choices[0].message.content and answer.choices[0].message.tool_calls is None
