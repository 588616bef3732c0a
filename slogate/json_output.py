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

import llguidance

ANY_OBJECT = '{"type":"object"}'
"""``response_format: {"type": "json_object"}``: any JSON object."""
ANY_VALUE = "{}"
"""A ``json_schema`` format without a schema: any JSON value."""

MAX_SCHEMA_BYTES = 64 * 1024
"""Largest schema accepted (as compact JSON text). Compiling takes time on the worker's compile
thread, which requests with new schemas queue for: 2,000 properties (69 KB) take 0.4 s on
2 CPU cores. OpenAI allows up to 5,000 properties."""
LIMITS = llguidance.LLParserLimits(max_items_in_row=10_000, verbose_errors=False)
"""llguidance's default row limit (2,000 Earley items) fails an object of 500 properties at its
first key; at 10,000 one of 2,000 works, its worst mask taking 3 ms. Errors stay one line
(verbose ones append the parser's state and the whole grammar, kilobytes a client cannot use)."""

_COMPACT = {"whitespace_flexible": False}


def grammar(schema: str) -> str:
    """llguidance's grammar for ``schema`` (JSON text). Raises ValueError when it is not a
    JSON object; whether the grammar compiles is :func:`schema_error`'s question."""
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_COMPACT)


def schema_error(schema: str) -> str | None:
    """Why ``schema`` cannot constrain output (an unknown type, a bad reference, a pattern that
    does not parse, a grammar over llguidance's size limits), or None when it can."""
    try:
        compiled = grammar(schema)
    except ValueError as exc:
        return str(exc)
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(compiled, limits=LIMITS)
    return messages[0] if failed else None
