"""Tool calls a model really writes, read back under ``tool_choice: "auto"``: the tiny model,
taught on the spot to answer two chats with ``<tool_call>`` blocks, behind a real gateway and
worker, through the SDK."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from engines.runtime.loader import encode_prompt
from engines.runtime.tiny_model import IM_END
from gateway.schema import parse
from slogate.local_redis import LocalRedis
from slogate.processes import Stack
from tests.e2e.conftest import start_engines, streamed_calls

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Today's weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ONE = [{"role": "user", "content": "Weather in Paris?"}]
TWO = [{"role": "user", "content": "Weather in Oslo and Lima?"}]
STEPS = 40
"""Adam steps on both lessons at once: 3.5 s on one core. Every answer token is then the
greedy choice by more than 5 logits; by 3 at 25 steps."""


def block(city: str) -> str:
    return f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}\n</tool_call>'


LESSONS = [(ONE, block("Paris")), (TWO, f"{block('Oslo')}\n{block('Lima')}")]


def prompt_ids(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """The prompt as the worker sees it: the chat as the gateway passes it on, rendered by the
    model's own template with the tools."""
    parsed = parse("chat", json.dumps({"model": "m", "messages": messages, "tools": [WEATHER]}).encode(), 16)
    return encode_prompt(tokenizer, "m", None, parsed.messages, parsed.tools)


@pytest.fixture(scope="module")
def taught_model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The seeded tiny model, taught each lesson's answer and the end of its turn by heart.
    Training is deterministic (the whole lessons every step, no dropout), and checked before
    any process serves the model: each answer must be its greedy choice at every token. On one
    thread: a second barely helps these small steps, and its spinning stalls them on a busy
    machine (40 s rather than 4 s, seen)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    end = tokenizer.convert_tokens_to_ids(IM_END)
    pairs = [(prompt_ids(tokenizer, chat), tokenizer(answer, add_special_tokens=False).input_ids + [end])
             for chat, answer in LESSONS]
    ids = torch.full((len(pairs), max(len(p) + len(a) for p, a in pairs)), tokenizer.pad_token_id)
    taught = torch.zeros_like(ids, dtype=torch.bool)  # where the next token is an answer's: only those are taught
    for row, (prompt, answer) in enumerate(pairs):
        ids[row, :len(prompt) + len(answer)] = torch.tensor(prompt + answer)
        taught[row, len(prompt) - 1:len(prompt) + len(answer) - 1] = True
    targets = ids[:, 1:][taught[:, :-1]]
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(STEPS):
            hidden = model.model(input_ids=ids).last_hidden_state[taught]
            loss = torch.nn.functional.cross_entropy(model.lm_head(hidden), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            guesses = model.lm_head(model.model(input_ids=ids).last_hidden_state[taught]).argmax(-1)
    finally:
        torch.set_num_threads(threads)
    assert guesses.tolist() == targets.tolist(), "the answers were not learnt"
    out = tmp_path_factory.mktemp("models") / "tool-llama"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tool_stack(redis_server: LocalRedis, taught_model: Path) -> Iterator[tuple[Stack, str]]:
    stack = start_engines(redis_server, taught_model, ("interactive", "stream"))
    yield stack, taught_model.name
    stack.stop()


def test_auto_reads_the_calls_the_model_writes_and_without_parallel_calls_its_first_alone(
        tool_stack: tuple[Stack, str], taught_model: Path) -> None:
    """Streamed or not, the same calls and nothing else. Without parallel calls the worker
    stops at the first block's end: the answer's tokens are those up to its closing tag."""
    stack, model = tool_stack
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    args = dict(model=model, tools=[WEATHER], tool_choice="auto", temperature=0, max_tokens=200,
                extra_headers={"x-slogate-class": "interactive"})
    used: dict[bool, int] = {}
    for chat, parallel, cities in [(ONE, openai.NOT_GIVEN, ["Paris"]), (TWO, True, ["Oslo", "Lima"]),
                                   (TWO, False, ["Oslo"])]:
        whole = client.chat.completions.create(messages=chat, parallel_tool_calls=parallel, **args)
        choice = whole.choices[0]
        assert (choice.finish_reason, choice.message.content) == ("tool_calls", None), (cities, choice)
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert [(name, json.loads(arguments)) for name, arguments in calls] == [
            ("get_weather", {"city": city}) for city in cities]
        chunks = list(client.chat.completions.create(messages=chat, parallel_tool_calls=parallel, stream=True,
                                                     stream_options={"include_usage": True}, **args))
        assert [(c["name"], c["arguments"]) for c in streamed_calls(chunks)[0]] == calls
        assert not any(c.choices[0].delta.content for c in chunks if c.choices)
        assert chunks[-2].choices[0].finish_reason == "tool_calls"
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
        if chat is TWO:
            used[parallel] = whole.usage.completion_tokens
    tokenizer = AutoTokenizer.from_pretrained(taught_model)
    taught = tokenizer(LESSONS[1][1], add_special_tokens=False).input_ids
    first = next(k for k in range(len(taught)) if "</tool_call>" in tokenizer.decode(taught[:k]))
    assert (used[True], used[False]) == (len(taught) + 1, first)  # the whole answer and its end; the first block


def test_without_parallel_calls_a_first_call_that_min_tokens_wrote_past_says_tool_calls(
        tool_stack: tuple[Stack, str], taught_model: Path) -> None:
    """``min_tokens`` keeps the worker writing past the first block's closing tag, and
    ``max_tokens`` then cuts it: what followed the call was dropped, yet the answer said "length"."""
    stack, model = tool_stack
    tokenizer = AutoTokenizer.from_pretrained(taught_model)
    taught = tokenizer(LESSONS[1][1], add_special_tokens=False).input_ids
    first = next(k for k in range(len(taught)) if "</tool_call>" in tokenizer.decode(taught[:k]))
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    args = dict(model=model, messages=TWO, tools=[WEATHER], tool_choice="auto", parallel_tool_calls=False,
                temperature=0, max_tokens=first + 3, extra_body={"min_tokens": first + 3},
                extra_headers={"x-slogate-class": "interactive"})
    whole = client.chat.completions.create(**args)
    choice = whole.choices[0]
    assert whole.usage.completion_tokens == first + 3, whole.usage
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", None), choice
    assert [json.loads(c.function.arguments) for c in choice.message.tool_calls] == [{"city": "Oslo"}]
    chunks = list(client.chat.completions.create(stream=True, **args))
    assert [json.loads(c["arguments"]) for c in streamed_calls(chunks)[0]] == [{"city": "Oslo"}]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
