"""JSON output (OpenAI's ``response_format``): the one definition of the grammar a JSON schema
becomes, shared by the gateway, which refuses a schema that cannot compile before anything is
queued, and the engines, which hold every sampled token to it (:mod:`engines.runtime.grammar`).

llguidance compiles the schema: it builds its lexer as tokens come, so a risk verdict's schema
costs a few milliseconds before the first token on the tiny model (compile and first mask)
rather than the seconds an automaton precompiled over the whole vocabulary can take, and it
imports no torch, so the gateway checks a schema with the engines' own compiler.

The JSON is compact (no whitespace between tokens) unless the schema's ``x-guidance`` options
ask otherwise: where whitespace may go anywhere, an unsure model pads. The tiny test model
filled ``max_tokens`` with spaces and newlines after its first key.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance

ANY_OBJECT = '{"type":"object"}'
"""``response_format: {"type": "json_object"}``: any JSON object."""
ANY_VALUE = "{}"
"""A ``json_schema`` format without a schema: any JSON value."""

MAX_SCHEMA_BYTES = 64 * 1024
"""Largest schema accepted (as compact JSON, in bytes). Compiling takes time on the worker's
compile thread, which requests with new schemas queue for: 2,000 integer properties named
``field_0`` to ``field_1999`` (69 KB, just over) take 0.4 s on 2 CPU cores. OpenAI allows up
to 5,000 properties."""
MAX_DEPTH = 128
"""Deepest chain of nested subschemas accepted, counting each object and list of the schema
and following local ``$ref`` links. llguidance compiles by recursion: 1,100 arrays nested
through ``$ref`` (61 KB) overflowed a thread's stack and killed the process (SIGSEGV). OpenAI
allows 10 levels of objects, some 30 here."""
LIMITS = llguidance.LLParserLimits(max_items_in_row=10_000, verbose_errors=False)
"""llguidance's default row limit (2,000 Earley items) fails an object of 500 properties at its
first key; at 10,000 one of 2,000 works, its worst mask taking 3 ms. Verbose errors append the
parser's state and the whole grammar, kilobytes a client cannot use."""

_COMPACT = {"whitespace_flexible": False}


def grammar(schema: str) -> str:
    """llguidance's grammar for ``schema`` (JSON text). Raises ValueError when it is not a
    JSON object or nests deeper than :data:`MAX_DEPTH`; whether the grammar compiles is
    :func:`schema_error`'s question."""
    try:
        document = json.loads(schema)
    except RecursionError:
        raise ValueError(f"the schema nests deeper than {MAX_DEPTH} levels") from None
    if isinstance(document, dict):
        try:
            _depth(document, document, {})
        except _TooDeep:
            raise ValueError(f"the schema nests deeper than {MAX_DEPTH} levels (counting objects, lists and "
                             "the $refs followed)") from None
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_COMPACT)


def schema_error(schema: str) -> str | None:
    """Why ``schema`` cannot constrain output (an unknown type, a bad reference, a pattern that
    does not parse, a grammar over llguidance's size limits), or None when it can."""
    try:
        compiled = grammar(schema)
    except ValueError as exc:
        return one_line(str(exc))
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(compiled, limits=LIMITS)
    return one_line(messages[0]) if failed else None


def one_line(message: str) -> str:
    """llguidance's message as one line for a client (a regex error points at the fault over
    three lines; a matcher's error ends with a marker line)."""
    return " ".join(line.strip() for line in message.splitlines() if line.strip() not in ("", "<non-verbose/>"))


class _TooDeep(Exception):
    pass


def _depth(node: Any, root: dict[str, Any], refs: dict[str, int], level: int = 0) -> int:
    """Levels of objects and lists from ``node`` (``level`` levels down) on, a local ``$ref``
    counted as the depth of what it points to (each worked out once; a reference back into its
    own chain, a recursive schema that llguidance compiles as a loop, as 0). Raises _TooDeep
    once past :data:`MAX_DEPTH`, so that the walk's own recursion stays bounded too."""
    if level > MAX_DEPTH:
        raise _TooDeep
    if isinstance(node, list):
        return 1 + max((_depth(v, root, refs, level + 1) for v in node if isinstance(v, (dict, list))), default=0)
    if not isinstance(node, dict):
        return 0
    deepest = 0
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        if ref not in refs:
            refs[ref] = 0  # while it is worked out: a reference back to it is a loop
            target = _pointer(root, ref)
            refs[ref] = _depth(target, root, refs, level + 1) if target is not None else 0
        deepest = refs[ref]
        if level + deepest > MAX_DEPTH:
            raise _TooDeep
    for value in node.values():
        if isinstance(value, (dict, list)):
            deepest = max(deepest, _depth(value, root, refs, level + 1))
    return 1 + deepest


def _pointer(root: dict[str, Any], ref: str) -> Any:
    """What a local JSON pointer (``#/$defs/a``) names in ``root``, or None."""
    node: Any = root
    for part in ref[1:].split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
