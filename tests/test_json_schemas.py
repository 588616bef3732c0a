"""Which JSON schemas the gateway lets through to the engines, and how it says why not."""

from __future__ import annotations

import json
import subprocess
import sys

from slogate import json_output
from slogate.processes import ROOT

CHAINS = {
    "plain": lambda n: {"$ref": "#/$defs/a0", "$defs": {
        **{f"a{i}": {"type": "array", "items": {"$ref": f"#/$defs/a{i + 1}"}} for i in range(n)},
        f"a{n}": {"type": "integer"}}},
    "percent-encoded": lambda n: {"$ref": "#/%24defs/0", "$defs": {
        **{f"{i}": {"type": "array", "items": {"$ref": f"#/%24defs/{i + 1}"}} for i in range(n)},
        f"{n}": {"type": "integer"}}},
    "by $id": lambda n: {"$id": "http://e/", "$ref": "0", "$defs": {
        **{f"{i}": {"$id": f"{i}", "type": "array", "items": {"$ref": f"{i + 1}"}} for i in range(n)},
        f"{n}": {"$id": f"{n}", "type": "integer"}}},
}
"""Arrays nested ``n`` deep, each through a ``$ref`` to the next, as three spellings of it."""


def chain(kind: str, levels: int) -> str:
    return json.dumps(CHAINS[kind](levels), separators=(",", ":"))


def test_ref_chains_as_deep_as_the_size_cap_allows_compile_on_the_compile_thread() -> None:
    """1,100 levels (61-64 KB, under the cap) overflowed a default thread stack in llguidance's
    recursive compile and killed the gateway (SIGSEGV); on the compile thread they compile. In
    a process of its own, so that a regression fails this test instead of the whole run."""
    probe = ("from tests.test_json_schemas import CHAINS, chain\nfrom slogate import json_output\n"
             "compiler = json_output.compiler('probe')\n"
             "for kind in CHAINS:\n"
             "    text = chain(kind, 1100)\n"
             "    assert len(text.encode()) <= json_output.MAX_SCHEMA_BYTES, (kind, len(text))\n"
             "    print(kind, compiler.submit(json_output.schema_error, text).result())\n")
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert result.stdout.splitlines() == [f"{kind} None" for kind in CHAINS]


def test_x_guidance_may_only_choose_whitespace() -> None:
    """Its other options let output stray: ``lenient`` drops keywords llguidance does not
    enforce, a separator of one's choosing is not JSON."""
    assert json_output.schema_error('{"type": "array", "x-guidance": {"whitespace_flexible": true}}') is None
    for options in ({"lenient": True}, {"item_separator": "; DROP "}, {"whitespace_pattern": ".*"}, "yes"):
        error = json_output.schema_error(json.dumps({"type": "array", "x-guidance": options}))
        assert error is not None and "only 'whitespace_flexible'" in error, options


def test_errors_are_one_line() -> None:
    error = json_output.schema_error('{"type": "string", "pattern": "(("}')
    assert error is not None and "\n" not in error
    assert error.startswith("regex parse error:") and "unclosed group" in error


def test_a_schema_nested_past_pythons_recursion_is_a_reason_not_a_crash() -> None:
    """990 levels pass the gateway's body decoder; Python's JSON parser then recursed too deep,
    and the error escaped as a 500."""
    nested = '{"type":"array","items":' * 990 + '{"type":"integer"}' + "}" * 990
    assert json_output.schema_error(nested) == "the schema is nested too deeply"


def test_bounds_that_leave_no_64_bit_integer_are_a_reason_not_a_crash() -> None:
    """llguidance holds integers to 64 bits: a ``maximum`` at -2**63 beside a ``minimum``
    killed the process checking it (SIGSEGV, the gateway's own, on its compile thread), and a
    ``minimum`` at 2**63 beside a ``maximum`` let 9223372036854775807 through. In a process of
    its own, so that a regression fails this test instead of the whole run."""
    schemas = [
        {"type": "integer", "minimum": -(2**63), "maximum": -(2**63)},
        {"type": "integer", "minimum": -1e19, "maximum": -9223372036854775806},
        {"type": ["integer", "null"], "allOf": [{"minimum": -1e20}, {"exclusiveMaximum": -1e19}]},
        {"type": "object", "properties": {"n": {"type": "integer", "minimum": 2**63, "maximum": 2**64}}},
    ]
    probe = ("import json, sys\nfrom slogate import json_output\ncompiler = json_output.compiler('probe')\n"
             "for schema in json.loads(sys.argv[1]):\n"
             "    print(compiler.submit(json_output.schema_error, json.dumps(schema)).result())\n")
    result = subprocess.run([sys.executable, "-c", probe, json.dumps(schemas)], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    errors = result.stdout.splitlines()
    assert len(errors) == len(schemas) and all("64-bit integer" in e for e in errors), errors
    assert json_output.schema_error('{"type": "integer", "minimum": 0, "maximum": 18446744073709551615}') is None


def test_a_multiple_of_beyond_what_a_grammar_can_hold_is_a_reason_not_a_hang() -> None:
    """``multipleOf: 2**25`` passed the gateway's check, then the worker's compile with the
    tokenizer never ended (gigabytes and growing), holding the worker's one compile thread.
    Above 2**16 no integer ``multipleOf`` compiles (the others fail with too many expressions),
    so they are all refused up front."""
    for step in (2**25, 2**31, 100_000):
        error = json_output.schema_error(json.dumps({"type": "object", "properties": {
            "n": {"type": "integer", "multipleOf": step}}}))
        assert error is not None and "multipleOf" in error, (step, error)
    for step in (3, 2048, 0.5):
        assert json_output.schema_error(json.dumps({"type": "number", "multipleOf": step})) is None, step
