"""Which JSON schemas the gateway lets through to the engines, and how it says why not."""

from __future__ import annotations

import json
import subprocess
import sys

from slogate import json_output
from slogate.processes import ROOT


def _array_chain(levels: int) -> str:
    """Arrays nested ``levels`` deep, each through a ``$ref`` to the next."""
    defs = {f"a{i}": {"type": "array", "items": {"$ref": f"#/$defs/a{i + 1}"}} for i in range(levels)}
    defs[f"a{levels}"] = {"type": "integer"}
    return json.dumps({"$ref": "#/$defs/a0", "$defs": defs})


def test_a_chain_deeper_than_the_limit_is_refused_before_llguidance_sees_it() -> None:
    assert json_output.schema_error(_array_chain(30)) is None
    error = json_output.schema_error(_array_chain(200))
    assert error is not None and f"deeper than {json_output.MAX_DEPTH} levels" in error
    nested = '{"allOf":[' * 300 + '{"type":"integer"}' + "]}" * 300
    assert "deeper than" in (json_output.schema_error(nested) or "")


def test_a_chain_that_overflowed_llguidances_stack_leaves_the_process_standing() -> None:
    """1,100 levels (61 KB, under the size cap) killed the gateway with SIGSEGV; in a process of
    its own here, so that a regression fails this test instead of the whole run."""
    probe = ("from tests.test_json_schemas import _array_chain\nfrom slogate import json_output\n"
             "print(json_output.schema_error(_array_chain(1100)))")
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "deeper than" in result.stdout


def test_recursive_and_widely_shared_references_are_not_too_deep() -> None:
    """A tree refers to itself (llguidance compiles it as a loop); forty levels of definitions
    that each refer twice to the next would be 2**40 paths if each were walked."""
    tree = {"$ref": "#/$defs/node", "$defs": {"node": {"type": "object", "properties": {
        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}}}
    assert json_output.schema_error(json.dumps(tree)) is None
    defs = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"$ref": f"#/$defs/d{i + 1}"}]} for i in range(40)}
    defs["d40"] = {"type": "integer"}
    assert json_output.schema_error(json.dumps({"$ref": "#/$defs/d0", "$defs": defs})) is None


def test_errors_are_one_line() -> None:
    error = json_output.schema_error('{"type": "string", "pattern": "(("}')
    assert error is not None and "\n" not in error
    assert error.startswith("regex parse error:") and "unclosed group" in error
