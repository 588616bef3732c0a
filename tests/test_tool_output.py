"""Tool calling, the answer's side: the model's text read back as calls, the same whether it
comes whole or a piece at a time."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from gateway.openai_shapes import ChunkWriter
from gateway.tool_output import Arguments, CallStart, Event, StreamedCalls, finish_reason, message, reader
from gateway.tools import ToolUse
from slogate.protocol import TokenLogprob

NAMES = frozenset({"get_weather", "now"})
AUTO = ToolUse("auto", NAMES)
AUTO_ONE = ToolUse("auto", NAMES, parallel=False)
REQUIRED = ToolUse("required", NAMES)
NAMED = ToolUse("named", NAMES, "get_weather")


def assembled(events: list[Event]) -> tuple[str, list[tuple[str, str]]]:
    """Content and (name, arguments) of each call, as a client adds up the chunks."""
    content, calls = "", []
    for e in events:
        if isinstance(e, str):
            content += e
        elif isinstance(e, CallStart):
            assert e.index == len(calls) and re.fullmatch(r"call_[0-9a-f]{24}", e.id)
            calls.append([e.name, ""])
        else:
            calls[e.index][1] += e.text
    return content, [tuple(c) for c in calls]


def streamed(use: ToolUse, pieces: list[str]) -> list[Event]:
    read = reader(use)
    events = [e for p in pieces for e in read.feed(p)]
    return events + read.end()


def every_split(use: ToolUse, text: str) -> tuple[str, list[tuple[str, str]]]:
    """What the reader makes of ``text`` whole; asserted the same for every place it may be
    cut in two, and for one character at a time."""
    whole = assembled(streamed(use, [text]))
    for k in range(len(text) + 1):
        assert assembled(streamed(use, [text[:k], text[k:]])) == whole, k
    assert assembled(streamed(use, list(text))) == whole
    return whole


def test_a_named_call_is_the_whole_output_and_starts_before_its_arguments() -> None:
    events = streamed(NAMED, ['{"city":', '"Paris"}'])
    assert isinstance(events[0], CallStart) and events[0].name == "get_weather"
    assert events[1:] == [Arguments(0, '{"city":'), Arguments(0, '"Paris"}')]
    assert every_split(NAMED, '{"city":"Pa{ris"}') == ("", [("get_weather", '{"city":"Pa{ris"}')])


@pytest.mark.parametrize("text,calls", [
    ('{"name":"get_weather","arguments":{"city":"Paris"}}', [("get_weather", '{"city":"Paris"}')]),
    ('[{"name":"get_weather","arguments":{"city":"a}\\"]{"}},{"name":"now","arguments":{}}]',
     [("get_weather", '{"city":"a}\\"]{"}'), ("now", "{}")]),
    ('[{"name":"now","arguments":{"at":{"zone":[1,{"x":"\\\\"}]}}}]', [("now", '{"at":{"zone":[1,{"x":"\\\\"}]}}')]),
])
def test_required_calls_are_read_name_first_and_arguments_as_they_come(text: str, calls: list) -> None:
    assert every_split(REQUIRED, text) == ("", calls)
    for _, arguments in calls:
        json.loads(arguments)


def test_a_required_call_cut_short_keeps_what_came() -> None:
    assert every_split(REQUIRED, '[{"name":"get_weather","arguments":{"city":"Pa') == (
        "", [("get_weather", '{"city":"Pa')])


HERMES = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize("text,content,calls", [
    ("Hello <tool_ there\n\n", "Hello <tool_ there\n\n", []),
    ("  a < b <tool_call", "  a < b <tool_call", []),
    (HERMES, "", [("get_weather", '{"city": "Paris"}')]),
    ("\n" * 100 + HERMES, "", [("get_weather", '{"city": "Paris"}')]),
    (f"Let me look.\n{HERMES}\n{HERMES.replace('Paris', 'Oslo')}\n",
     "Let me look.", [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Oslo"}')]),
    (f"{HERMES}\n\nIt is sunny.", "It is sunny.", [("get_weather", '{"city": "Paris"}')]),
    ('<tool_call>{"name": "now", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>', "", [("now", '{"tz": "UTC"}')]),
    ('<tool_call>{"name": "now"}</tool_call>', "", [("now", "{}")]),
    ('<tool_call>\n{"name": "now", "arguments": {}}', "", [("now", "{}")]),
    ('x <tool_call>{"name": "rm", "arguments": {}}</tool_call> y', 'x <tool_call>{"name": "rm", "arguments": {}}'
     '</tool_call> y', []),
    ('x <tool_call>{"name": "now", "arguments": [1]}</tool_call>', 'x <tool_call>{"name": "now", "arguments": [1]}'
     '</tool_call>', []),
    ('x <tool_call>{"name": "now", "argu', 'x <tool_call>{"name": "now", "argu', []),
    (f'{HERMES} <tool_call>{{bad</tool_call>', "<tool_call>{bad</tool_call>", [("get_weather", '{"city": "Paris"}')]),
])
def test_auto_reads_hermes_blocks_and_leaves_the_rest_as_written(text: str, content: str, calls: list) -> None:
    assert every_split(AUTO, text) == (content, calls)


OSLO = HERMES.replace("Paris", "Oslo")


@pytest.mark.parametrize("text,content,calls", [
    (f"Let me look.\n{HERMES}\n{OSLO}\nDone.", "Let me look.", [("get_weather", '{"city": "Paris"}')]),
    (f"{HERMES} and then <tool_c", "", [("get_weather", '{"city": "Paris"}')]),
    (HERMES.removesuffix("</tool_call>"), "", [("get_weather", '{"city": "Paris"}')]),  # as its stop leaves it
    (f"<tool_call>{{bad</tool_call> {HERMES}{OSLO}", "<tool_call>{bad</tool_call>",
     [("get_weather", '{"city": "Paris"}')]),
    ("no call", "no call", []),
])
def test_auto_without_parallel_calls_ends_at_the_first_call(text: str, content: str, calls: list) -> None:
    assert every_split(AUTO_ONE, text) == (content, calls)


def test_text_that_may_yet_open_a_block_is_held_and_the_rest_is_sent_at_once() -> None:
    read = reader(AUTO)
    assert read.feed("Sure, <tool") == ["Sure,"]
    assert read.feed("box> is it ") == [" <toolbox> is it"]
    assert read.end() == [" "]


@pytest.mark.parametrize("use,text,expected", [
    (AUTO, "plain", ("plain", [])),
    (AUTO, f"ok {HERMES}", ("ok", [{"name": "get_weather", "arguments": '{"city": "Paris"}'}])),
    (AUTO, HERMES, (None, [{"name": "get_weather", "arguments": '{"city": "Paris"}'}])),
    (AUTO_ONE, f"{HERMES}\n{HERMES} more", (None, [{"name": "get_weather", "arguments": '{"city": "Paris"}'}])),
    (NAMED, "{}", (None, [{"name": "get_weather", "arguments": "{}"}])),
    (NAMED, "", (None, [{"name": "get_weather", "arguments": ""}])),
])
def test_a_whole_answers_message(use: ToolUse, text: str, expected: tuple[Any, list]) -> None:
    content, calls = message(use, text)
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert (content, [c["function"] for c in calls]) == expected


def test_an_answer_that_ended_with_calls_says_tool_calls_unless_cut_short() -> None:
    assert [finish_reason("stop", 1, AUTO), finish_reason("length", 1, AUTO), finish_reason("stop", 0, AUTO)] == [
        "tool_calls", "length", "stop"]
    assert [finish_reason("length", 1, REQUIRED), finish_reason("length", 1, NAMED)] == ["length", "length"]


def finished(use: ToolUse, text: str, finish: str, streaming: bool) -> str:
    """The finish reason of an answer of ``text`` whose generation ``finish`` ended, as it is sent."""
    if not streaming:
        return finish_reason(finish, len(message(use, text)[1]), use)
    calls = StreamedCalls(use, ChunkWriter("chat", "chatcmpl-1", 0, "m", index=0))
    frames = calls.text(text[:20], None, None) + calls.text(text[20:], None, None) + calls.finish(finish)
    return json.loads(frames[-1].removeprefix(b"data: "))["choices"][0]["finish_reason"]


@pytest.mark.parametrize("streaming", [False, True])
def test_without_parallel_calls_a_whole_first_call_says_tool_calls_whatever_ended_the_text_after_it(
        streaming: bool) -> None:
    """With ``min_tokens`` the worker ignores the closing tag's stop string, writes on, and
    ``max_tokens`` cuts it: what follows the call was dropped, yet the answer said "length"."""
    text = f"{HERMES}\nand then some more text the reader drops, cut by max_tok"
    assert finished(AUTO_ONE, text, "length", streaming) == "tool_calls"
    assert finished(AUTO, text, "length", streaming) == "length", "with parallel calls, more may have been cut"
    cut = HERMES[:HERMES.index("Paris") + 3]
    assert finished(AUTO_ONE, cut, "length", streaming) == "length", "the call itself was cut"


def test_streamed_calls_are_openais_chunks_and_held_tokens_log_probabilities_ride_on_the_next() -> None:
    writer = ChunkWriter("chat", "chatcmpl-1", 0, "m", index=1)
    calls = StreamedCalls(AUTO, writer)
    entry = TokenLogprob("<tool", b"<tool", -0.5)
    assert calls.text("<tool", None, [entry]) == []
    frames = calls.text(HERMES[5:], {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}, [entry])
    frames += calls.finish("stop")
    chunks = [json.loads(f.removeprefix(b"data: ")) for f in frames]
    assert [c["choices"][0]["index"] for c in chunks] == [1, 1, 1]
    start, arguments, end = (c["choices"][0] for c in chunks)
    called = {"name": "get_weather", "arguments": ""}
    assert start["delta"] == {"tool_calls": [{"index": 0, "id": start["delta"]["tool_calls"][0]["id"],
                                              "type": "function", "function": called}]}
    assert arguments["delta"] == {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris"}'}}]}
    assert [len(start["logprobs"]["content"]), len(arguments["logprobs"]["content"])] == [2, 0]
    assert chunks[1]["usage"]["completion_tokens"] == 2
    assert (end["delta"], end["finish_reason"], end["logprobs"]) == ({}, "tool_calls", None)


def test_streamed_without_parallel_calls_one_call_is_sent_and_ends_the_choice() -> None:
    calls = StreamedCalls(AUTO_ONE, ChunkWriter("chat", "chatcmpl-1", 0, "m", index=0))
    frames = calls.text(f"{HERMES}\n", None, None) + calls.text(f"{OSLO} bye", None, None) + calls.finish("stop")
    choices = [json.loads(f.removeprefix(b"data: "))["choices"][0] for f in frames]
    assert [c["finish_reason"] for c in choices] == [None, None, "tool_calls"]
    assert [(d["index"], d["function"]) for c in choices[:2] for d in c["delta"]["tool_calls"]] == [
        (0, {"name": "get_weather", "arguments": ""}), (0, {"arguments": '{"city": "Paris"}'})]
