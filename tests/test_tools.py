"""Tool calling, the request's side: what ``tools`` and ``tool_choice`` hold the output to, the
calls in a chat's history, and a 400 naming the place of each thing wrong."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from gateway.errors import APIError
from gateway.schema import ParsedRequest, check_json_schema, parse

USER = {"role": "user", "content": "weather in Paris?"}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Today's weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
ORDER = {"type": "function", "function": {
    "name": "order-item_2",
    "parameters": {"type": "object", "properties": {"item": {"$ref": "#/$defs/Item"}}, "required": ["item"],
                   "$defs": {"Item": {"type": "object", "properties": {"sku": {"type": "integer"}},
                                      "required": ["sku"]}}}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def chat(**fields: Any) -> ParsedRequest:
    return parse("chat", json.dumps({"model": "m", "messages": [USER], **fields}).encode(), default_max_tokens=16)


def refused(param: str, words: str, kind: str = "chat", **fields: Any) -> APIError:
    body = {"model": "m", **({"messages": [USER]} if kind == "chat" else {"prompt": "x"}), **fields}
    with pytest.raises(APIError) as err:
        parse(kind, json.dumps(body).encode(), default_max_tokens=16)
    assert (err.value.status, err.value.param) == (400, param), err.value.message
    assert words in err.value.message
    return err.value


def test_tools_reach_the_template_and_auto_is_the_default() -> None:
    parsed = chat(tools=[WEATHER, {"type": "function", "function": {"name": "now", "strict": True}}])
    assert parsed.tools == [WEATHER, {"type": "function", "function": {
        "name": "now", "parameters": {"type": "object", "properties": {}}}}]
    assert (parsed.tool_use.mode, parsed.tool_use.names) == ("auto", {"get_weather", "now"})
    assert parsed.sampling.json_schema is None
    assert parsed.prompt_chars == len(USER["content"]) + len(json.dumps(parsed.tools, separators=(",", ":")))


def test_none_shows_the_tools_and_reads_the_answer_as_text() -> None:
    parsed = chat(tools=[WEATHER], tool_choice="none", response_format={"type": "json_object"})
    assert parsed.tools == [WEATHER] and parsed.tool_use is None
    assert parsed.sampling.schema_param is None


def test_a_named_function_holds_the_output_to_its_parameters() -> None:
    parsed = chat(tools=[ORDER, WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(parsed.sampling.json_schema) == WEATHER["function"]["parameters"]
    assert parsed.sampling.schema_param == "tools[1].function.parameters"
    assert (parsed.tool_use.mode, parsed.tool_use.name) == ("named", "get_weather")


@pytest.mark.parametrize("parallel", [True, None, False])
def test_required_holds_the_output_to_calls_of_the_tools(parallel: bool | None) -> None:
    """Each call names one tool and holds its arguments to that tool's parameters, their $refs
    resolved inside them; in parallel, one or more of them."""
    fields = {} if parallel is None else {"parallel_tool_calls": parallel}
    parsed = chat(tools=[WEATHER, ORDER], tool_choice="required", **fields)
    assert parsed.sampling.schema_param == "tools" and parsed.tool_use.mode == "required"
    assert parsed.tool_use.parallel is (parallel is not False)
    schema = json.loads(parsed.sampling.json_schema)
    weather = {"name": "get_weather", "arguments": {"city": "Paris"}}
    order = {"name": "order-item_2", "arguments": {"item": {"sku": 7}}}
    good, bad = ([[weather, order]], [[], [{**weather, "name": "order-item_2"}], weather]) if parallel is not False \
        else ([weather, order], [[weather], {**order, "arguments": {"item": {"sku": "x"}}}])
    validator = jsonschema.Draft202012Validator(schema)
    for value in good:
        validator.validate(value)
    for value in bad:
        assert not validator.is_valid(value), value


async def test_a_named_functions_schema_that_cannot_compile_is_a_400_naming_it() -> None:
    broken = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"$ref": "#/$defs/missing"}}}}}
    parsed = chat(tools=[WEATHER, broken], tool_choice={"type": "function", "function": {"name": "f"}})
    with pytest.raises(APIError) as err:
        await check_json_schema(parsed)
    assert err.value.param == "tools[1].function.parameters"
    assert err.value.message.startswith("'tools[1].function.parameters' is not a schema output can be held to")


@pytest.mark.parametrize("fields,param,words", [
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "get weather"}}]}, "tools[1].function.name",
     "1 to 64 letters"),
    ({"tools": [{"type": "function", "function": {"name": "f" * 65}}]}, "tools[0].function.name", "1 to 64"),
    ({"tools": [WEATHER, ORDER, WEATHER]}, "tools[2].function.name", "also tools[0]'s; names must be unique"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters", "of type 'object'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
     "tools[0].function.parameters", "Expected `object | null`"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameterz": {}}}]},
     "tools[0].function.parameterz", "unknown parameter"),
    ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools[0].custom", "unknown parameter"),
    ({"tools": [{"type": "custom"}]}, "tools[0].type", "only tools of type 'function'"),
    ({"tools": [{"type": "function"}]}, "tools[0].function", "needs 'function'"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "tools",
     "at most 128 tools"),
    ({"tools": [WEATHER], "tool_choice": "any"}, "tool_choice", "'none', 'auto', 'required' or"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "allowed_tools": {}}}, "tool_choice.type",
     "must be 'function'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice.function", "'name' of the one"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice.function.name", "'f', which no tool defines"),
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice", "needs 'tools'"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format",
     "unless 'tool_choice' is 'none'"),
    ({"tools": [WEATHER], "tool_choice": "required", "stop": ["}"]}, "stop",
     "'tool_choice' 'required' or a named function"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
      "stop_token_ids": [5]}, "stop_token_ids", "cut the JSON short"),
    ({"functions": [WEATHER["function"]]}, "functions", "deprecated forms of 'tools' and 'tool_choice'"),
    ({"function_call": "auto"}, "function_call", "deprecated forms"),
])
def test_each_bad_tool_is_a_400_naming_its_place(fields: dict[str, Any], param: str, words: str) -> None:
    refused(param, words, **fields)


def test_auto_may_be_cut_by_stop_strings() -> None:
    """A stop string inside a call leaves its text as content: nothing is cut that was held."""
    assert chat(tools=[WEATHER], stop=["\n"]).sampling.stop == ["\n"]


def test_auto_without_parallel_calls_stops_at_the_first_blocks_closing_tag_beside_the_clients_stops() -> None:
    assert chat(tools=[WEATHER], parallel_tool_calls=False).sampling.stop == ["</tool_call>"]
    assert chat(tools=[WEATHER], parallel_tool_calls=False, stop="\n\n").sampling.stop == ["\n\n", "</tool_call>"]
    assert chat(tools=[WEATHER], parallel_tool_calls=False, stop=["</tool_call>"]).sampling.stop == ["</tool_call>"]
    one = chat(tools=[WEATHER], tool_choice="auto", parallel_tool_calls=False)
    assert (one.tool_use.mode, one.tool_use.parallel) == ("auto", False)
    assert chat(tools=[WEATHER], parallel_tool_calls=True).sampling.stop == []
    for choice in ("none", "required"):  # text, or one call its schema ends
        assert chat(tools=[WEATHER], tool_choice=choice, parallel_tool_calls=False).sampling.stop == []


def test_completions_have_no_tools() -> None:
    refused("tools", "chat completions", kind="completion", tools=[WEATHER])


def test_a_chat_with_calls_and_their_results_reaches_the_template() -> None:
    calls = [CALL, {**CALL, "id": "call_2", "index": 1}]
    messages = [USER, {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "tool_call_id": "call_2", "content": "5C"},
                {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "20C"}]}]
    parsed = chat(messages=messages, tools=[WEATHER])
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    assert parsed.messages[1:] == [
        {"role": "assistant", "content": "", "tool_calls": [call, {**call, "id": "call_2"}]},
        {"role": "tool", "content": "5C", "tool_call_id": "call_2"},
        {"role": "tool", "content": "20C", "tool_call_id": "call_1"}]
    assert parsed.tool_chars > len(json.dumps(parsed.tools, separators=(",", ":")))


@pytest.mark.parametrize("message,param,words", [
    ({"role": "tool", "content": "x"}, "messages[2].tool_call_id", "needs 'tool_call_id'"),
    ({"role": "tool", "tool_call_id": "call_9", "content": "x"}, "messages[2].tool_call_id",
     "'call_9', which no earlier assistant message's 'tool_calls' made"),
    ({"role": "tool", "tool_call_id": "call_1"}, "messages[2].content", "needs 'content'"),
    ({"role": "user", "content": "x", "tool_calls": [CALL]}, "messages[2].tool_calls", "only an assistant message"),
    ({"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{bad"}}]},
     "messages[2].tool_calls[0].function.arguments", "a JSON object, as text"),
    ({"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "[1]"}}]},
     "messages[2].tool_calls[0].function.arguments", "a JSON object, as text"),
    ({"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": {"city": "x"}}}]},
     "messages[2].tool_calls[0].function.arguments", "Expected `str`"),
    ({"role": "assistant", "tool_calls": [CALL, {**CALL, "function": {"name": "a b", "arguments": "{}"}}]},
     "messages[2].tool_calls[1].function.name", "1 to 64 letters"),
    ({"role": "assistant", "tool_calls": [{**CALL, "id": ""}]}, "messages[2].tool_calls[0].id", "1 to 256"),
    ({"role": "assistant", "tool_calls": [{**CALL, "type": "custom"}]}, "messages[2].tool_calls[0].type",
     "of type 'function'"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]},
     "messages[2].tool_calls[0].function", "missing required field"),
    ({"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}}, "messages[2].function_call",
     "deprecated form of 'tool_calls'"),
])
def test_each_bad_call_or_result_in_the_history_is_a_400_naming_it(message: dict[str, Any], param: str,
                                                                    words: str) -> None:
    history = [USER, {"role": "assistant", "tool_calls": [CALL]}, message]
    refused(param, words, messages=history)
