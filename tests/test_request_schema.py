"""What parsing a request costs: no more than its bytes, whatever a field the gateway only
checks for presence (or ignores) holds; and which fields inside its objects it knows."""

from __future__ import annotations

import codecs
import tracemalloc

import msgspec
import openai.types.chat as sdk
import pytest
from openai.types.chat.chat_completion_content_part_param import File
from openai.types.shared_params import FunctionDefinition
from openai.types.shared_params.response_format_json_schema import JSONSchema

from gateway import schema, tools
from gateway.errors import APIError
from gateway.schema import parse

MIB = 1 << 20


@pytest.mark.parametrize("head,tail", [
    ('{"model":"m","messages":[{"role":"user","content":"x"}],"metadata":{"a":[', "]}}"),
    ('{"model":"m","messages":[{"role":"user","content":"x"}],"tools":[', "]}"),
    ('{"model":"m","messages":[{"role":"user","content":"x"}],"tool_choice":[', "]}"),
    ('{"model":"m","messages":[{"role":"assistant","tool_calls":[', "]}]}"),
])
def test_an_ignored_or_refused_field_costs_no_more_than_its_bytes(head: str, tail: str) -> None:
    """A 1 MiB body of empty arrays in such a field must not be built into ~350,000 Python
    lists (about 22 MB and 70 ms of the event loop) before it is looked at."""
    body = (head + ",".join(["[]"] * ((MIB - len(head) - len(tail)) // 3)) + tail).encode()
    tracemalloc.start()
    try:
        parse("chat", body, default_max_tokens=16)
    except APIError:
        pass
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 4 * len(body), f"{peak / 1e6:.1f} MB allocated for a {len(body) / 1e6:.1f} MB body"


@pytest.mark.parametrize("field,value,refused", [
    ("tools", "[]", False), ("tools", "null", False), ("tools", " [ ] ", False),
    ("tool_choice", '"none"', False), ("tool_choice", '"auto"', True), ("tool_choice", '{"type": "function"}', True),
    ("function_call", '"none"', False), ("functions", "[]", False), ("functions", "[{}]", True),
    ("audio", "null", False), ("audio", "{}", True), ("metadata", '{"a": [1, {"b": 2}]}', False),
])
def test_fields_kept_raw_are_judged_by_what_they_hold(field: str, value: str, refused: bool) -> None:
    body = f'{{"model": "m", "messages": [{{"role": "user", "content": "x"}}], "{field}": {value}}}'.encode()
    try:
        parse("chat", body, default_max_tokens=16)
    except APIError as err:
        assert refused and err.param == field, err
    else:
        assert not refused


CHAT = '{"model": "m", "messages": [{"role": "user", "content": "x"%s}]%s}'


@pytest.mark.parametrize("field", ["tool_choice", "function_call"])
def test_an_out_of_range_number_in_a_raw_field_is_a_400_not_a_crash(field: str) -> None:
    with pytest.raises(APIError) as err:
        parse("chat", (CHAT % ("", f', "{field}": 1e999')).encode(), 16)
    assert err.value.status == 400


@pytest.mark.parametrize("name", ["agent.1", "José", "dr.who@example"])
def test_a_name_openai_accepts_is_accepted(name: str) -> None:
    """OpenAI's pattern for a message's name is no whitespace, nor any of <|\\/>."""
    parsed = parse("chat", (CHAT % (f', "name": "{name}"', "")).encode(), 16)
    assert parsed.messages[0]["name"] == name


def test_a_name_with_a_trailing_newline_does_not_reach_the_template() -> None:
    """msgspec's pattern is re.search, and '$' matches before a final newline."""
    with pytest.raises(APIError):
        parse("chat", (CHAT % (', "name": "bob\\n"', "")).encode(), 16)


@pytest.mark.parametrize("body,param", [
    (CHAT % (', "foo": 1', ""), "messages[0].foo"),
    ('{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "x", "foo": 1}]}]}',
     "messages[0].content[0].foo"),
    (CHAT % ("", ', "stream": true, "stream_options": {"include_usage": true, "foo": 1}'), "stream_options.foo"),
    (CHAT % ("", ', "response_format": {"type": "text", "foo": 1}'), "response_format.foo"),
    (CHAT % ("", ', "response_format": {"type": "json_schema", "json_schema": {"name": "n", "foo": 1}}'),
     "response_format.json_schema.foo"),
])
def test_an_unknown_field_inside_an_object_is_refused_by_its_path(body: str, param: str) -> None:
    """As at the top level: a field this gateway does not know is refused, not ignored."""
    with pytest.raises(APIError) as err:
        parse("chat", body.encode(), 16)
    assert (err.value.status, err.value.type, err.value.param, err.value.code) == (
        400, "invalid_request_error", param, "unsupported_parameter")
    assert f"'{param}'" in err.value.message


def _keys(typed: type) -> set[str]:
    return set(typed.__required_keys__ | typed.__optional_keys__)


def _fields(struct: type) -> set[str]:
    return {f.encode_name for f in msgspec.structs.fields(struct)}


@pytest.mark.parametrize("sent,struct", [
    (sdk.ChatCompletionSystemMessageParam, schema.Message), (sdk.ChatCompletionDeveloperMessageParam, schema.Message),
    (sdk.ChatCompletionUserMessageParam, schema.Message), (sdk.ChatCompletionAssistantMessageParam, schema.Message),
    (sdk.ChatCompletionToolMessageParam, schema.Message),
    (sdk.ChatCompletionContentPartTextParam, schema.ContentPart),
    (sdk.ChatCompletionContentPartImageParam, schema.ContentPart),
    (sdk.ChatCompletionContentPartInputAudioParam, schema.ContentPart), (File, schema.ContentPart),
    (sdk.ChatCompletionContentPartRefusalParam, schema.ContentPart),
    (sdk.ChatCompletionStreamOptionsParam, schema.StreamOptions), (JSONSchema, schema.JsonSchemaFormat),
    (sdk.ChatCompletionFunctionToolParam, tools.Tool), (FunctionDefinition, tools.Function),
    (sdk.ChatCompletionNamedToolChoiceParam, tools.ToolChoice),
    (sdk.ChatCompletionAllowedToolChoiceParam, tools.ToolChoice),
    (sdk.ChatCompletionNamedToolChoiceCustomParam, tools.ToolChoice),
    (sdk.ChatCompletionMessageFunctionToolCallParam, tools.ToolCall),
])
def test_every_field_the_openai_sdk_sends_inside_an_object_is_known(sent: type, struct: type) -> None:
    """Known, whether it is then used, ignored or refused for what it asks: never refused as unknown."""
    assert _keys(sent) <= _fields(struct)


@pytest.mark.parametrize("message", [
    '{"role": "user", "tool_call_id": "c1", "content": "x"}',
    '{"role": "assistant", "content": "x", "refusal": null, "audio": null, "tool_calls": null}',
    '{"role": "user", "content": [{"type": "text", "text": "x", "prompt_cache_breakpoint": {"mode": "explicit"}}]}',
    '{"role": "assistant", "content": "x", "reasoning_content": "hm", "reasoning": "hm", "annotations": []}',
    '{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}], '
    '"cache_control": {"type": "ephemeral"}}',
])
def test_a_message_with_fields_known_but_without_effect_is_accepted(message: str) -> None:
    parsed = parse("chat", f'{{"model": "m", "messages": [{message}]}}'.encode(), 16)
    assert parsed.messages[0]["content"] == "x"


@pytest.mark.parametrize("message,param,words", [
    ('{"role": "assistant", "content": null, "refusal": "no"}', "messages[0].refusal", "refusal"),
    ('{"role": "assistant", "content": null, "audio": {"id": "a1"}}', "messages[0].audio", "only text"),
    ('{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}', "messages[0].content[0].type",
     "only text content parts"),
])
def test_a_known_field_asking_for_what_the_gateway_lacks_is_refused(message: str, param: str, words: str) -> None:
    with pytest.raises(APIError) as err:
        parse("chat", f'{{"model": "m", "messages": [{message}]}}'.encode(), 16)
    assert (err.value.param, err.value.code) == (param, "unsupported_value") and words in err.value.message


def test_stream_options_openai_sends_are_accepted() -> None:
    body = CHAT % ("", ', "stream": true, "stream_options": {"include_usage": true, "include_obfuscation": false}')
    assert parse("chat", body.encode(), 16).include_usage


@pytest.mark.parametrize("content", [r"\ud83d", r"hi \udbff", r"\ud800"])
def test_a_lone_surrogate_at_the_end_of_a_body_is_named_not_called_a_truncated_body(content: str) -> None:
    """Half an emoji, as a client that cut its text and ``JSON.stringify`` escape it, in the last
    message's content: only ``"}]}`` follows it, and msgspec, finding fewer than six bytes after a
    high surrogate's escape, says the input was truncated."""
    body = f'{{"model": "m", "messages": [{{"role": "user", "content": "{content}"}}]}}'.encode()
    with pytest.raises(APIError) as err:
        parse("chat", body, 16)
    assert err.value.code == "invalid_json"
    assert "surrogate" in err.value.message and "truncated" not in err.value.message, err.value.message


@pytest.mark.parametrize("body", [b'{"model": "m", "messages": [{"role": "user", "content": "x',
                                  b'{"model": "m", "messages": [{"role": "user", "content": "\\ud83d'])
def test_a_body_that_is_cut_short_is_called_truncated(body: bytes) -> None:
    with pytest.raises(APIError) as err:
        parse("chat", body, 16)
    assert err.value.code == "invalid_json" and "truncated" in err.value.message, err.value.message


@pytest.mark.parametrize("encoded", [
    codecs.BOM_UTF8 + (CHAT % ("", "")).encode(), (CHAT % ("", "")).encode("utf-16"),
    codecs.BOM_UTF16_BE + (CHAT % ("", "")).encode("utf-16-be")], ids=["utf-8-bom", "utf-16-le", "utf-16-be"])
def test_a_body_with_a_byte_order_mark_is_refused_naming_it(encoded: bytes) -> None:
    """A byte order mark is invisible in an editor: 'invalid character (byte 0)' pointed at a '{'."""
    with pytest.raises(APIError) as err:
        parse("chat", encoded, 16)
    assert err.value.code == "invalid_encoding"
    assert "byte order mark" in err.value.message and "UTF-8" in err.value.message, err.value.message
