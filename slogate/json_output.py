"""JSON output (OpenAI's ``response_format``): the one definition of the grammar a JSON schema
becomes, shared by the gateway, which refuses a schema that cannot compile before anything is
queued, and the engines, which hold every sampled token to it (:mod:`engines.runtime.grammar`).

llguidance compiles the schema: it builds its lexer as tokens come, so a risk verdict's schema
costs a few milliseconds before the first token on the tiny model (compile and first mask)
rather than the seconds an automaton precompiled over the whole vocabulary can take, and it
imports no torch, so the gateway checks a schema with the engines' own compiler.

The JSON is compact (no whitespace between tokens) unless the schema's ``x-guidance`` asks
otherwise (``whitespace_flexible``): where whitespace may go anywhere, an unsure model pads.
The tiny test model filled ``max_tokens`` with spaces and newlines after its first key.
"""

from __future__ import annotations

import hashlib
import json
import threading
from concurrent.futures import ThreadPoolExecutor
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
COMPILE_STACK_BYTES = 256 * 2**20
"""Stack of the threads that compile schemas. llguidance compiles by recursion, and ``$ref``
chains nest without limit: 1,100 arrays chained through ``$ref`` (61 KB) overflowed a default
8 MB thread stack and killed the process (SIGSEGV); the tersest chains fit some 3,000 links in
:data:`MAX_SCHEMA_BYTES`. The stack is address space, reserved, not memory used."""
LIMITS = llguidance.LLParserLimits(max_items_in_row=10_000, max_lexer_states=20_000, initial_lexer_fuel=200_000,
                                   step_lexer_fuel=50_000, verbose_errors=False)
"""What one schema may cost. A request past these ends with an error; its neighbours go on.

- Row limit 10,000 Earley items (default 2,000): at 2,000 an object of 500 properties failed at
  its first key; at 10,000 one of 2,000 works, its worst mask taking 3 ms.
- Lexer states 20,000, initial fuel 200,000, step fuel 50,000 (defaults 250,000, 1,000,000 and
  200,000). At the defaults a 49-byte pattern (``^(X{1000}){1000}$``) took 1.2 s and 258 MB to
  compile, kept for as long as the schema stays cached. Another one (eight ``(a{300}){300}``
  alternatives) took 22 ms of the engine's thread every token, each stream waiting for it. Now
  they cost 0.14 s and 48 MB, and a few masks of up to 20 ms before failing. A 5,000-value
  enum, 1,800 properties, every string format, and 1,000 properties with patterns work, their
  masks at most 2 ms (tiny model).
- Verbose errors off: they append the parser's state and the whole grammar, kilobytes a
  client cannot use."""

_COMPACT = {"whitespace_flexible": False}
_LOWER_BOUNDS = ("minimum", "exclusiveMinimum")
_UPPER_BOUNDS = ("maximum", "exclusiveMaximum")
_INT64_EDGE = 2**63 - 512
"""Where a number rounds to 2**63 as a double, as llguidance reads bounds."""
MAX_MULTIPLE_OF = 2**16
"""The largest integer ``multipleOf`` accepted. Above it none compiles with a tokenizer: most
fail at once (too many expressions), but powers of two from 2**25 on never finish, growing by
gigabytes on the worker's one compile thread, while the tokenizer-free check passes them."""


def grammar(schema: str) -> str:
    """llguidance's grammar for ``schema`` (JSON text). Raises ValueError when it is not a
    JSON object, its ``x-guidance`` options ask for more than whitespace, or a bound leaves no
    64-bit integer (:func:`_check_bounds`); whether the grammar compiles is
    :func:`schema_error`'s question. Compile it on a thread of :func:`compiler`."""
    try:
        document = json.loads(schema)
    except RecursionError:
        raise ValueError("the schema is nested too deeply") from None
    _check_bounds(document)
    options = document.get("x-guidance") if isinstance(document, dict) else None
    if options is not None and (not isinstance(options, dict) or set(options) - {"whitespace_flexible"}):
        raise ValueError("of the 'x-guidance' options only 'whitespace_flexible' is accepted: the others "
                         "(lenient, separators, whitespace patterns) let output stray from the schema or from JSON")
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_COMPACT)


def _check_bounds(document: Any) -> None:
    """Refuse an integer ``multipleOf`` above ``MAX_MULTIPLE_OF``, a lower bound at or above
    2**63, or an upper one at or below -2**63: llguidance
    holds integers to 64 bits, and beside a bound on the other side such a bound crashed the
    whole process (SIGSEGV: ``maximum`` -2**63 with a ``minimum``, the gateway's own on its
    check) or let a value out of range through (``minimum`` 2**63 with a ``maximum`` gave
    9223372036854775807). Looked for anywhere, whatever the type: ``allOf`` may carry the
    bounds apart, and llguidance refused most numbers' bounds this far out already."""
    nodes = [document]
    while nodes:
        node = nodes.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if not isinstance(value, (int, float)) or isinstance(value, bool):
                    continue
                if key in _LOWER_BOUNDS and value >= _INT64_EDGE or key in _UPPER_BOUNDS and -value >= _INT64_EDGE:
                    raise ValueError(f"'{key}' is {value}: bounds must leave room for a 64-bit integer "
                                     f"(from -2**63 to 2**63 - 1)")
                if key == "multipleOf" and isinstance(value, int) and value > MAX_MULTIPLE_OF:
                    raise ValueError(f"'multipleOf' is {value}: at most {MAX_MULTIPLE_OF} can be enforced")
            nodes.extend(node.values())
        elif isinstance(node, list):
            nodes.extend(node)


def digest(schema: str) -> bytes:
    """What compiled schemas are kept by."""
    return hashlib.blake2b(schema.encode(), digest_size=16).digest()


def compiler(name: str) -> ThreadPoolExecutor:
    """A one-thread executor for compiling schemas, its thread started now with a stack of
    :data:`COMPILE_STACK_BYTES` (the size applies to threads started while it is set)."""
    executor = ThreadPoolExecutor(1, thread_name_prefix=name)
    previous = threading.stack_size(COMPILE_STACK_BYTES)
    try:
        executor.submit(int).result()
    finally:
        threading.stack_size(previous)
    return executor


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
