"""What parsing a request costs: no more than its bytes, whatever a field the gateway only
checks for presence (or ignores) holds."""

from __future__ import annotations

import tracemalloc

import pytest

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
    ("tools", "[]", False), ("tools", "null", False), ("tools", " [ ] ", False), ("tools", '[{"type": "x"}]', True),
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
