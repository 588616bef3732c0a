"""OpenAI tool calling, the request's side: the functions a chat offers the model, the calls in
its history, and what ``tool_choice`` holds the answer to.

The model sees its tools through its chat template, which the worker renders. A named function
or ``"required"`` holds the output to JSON as ``response_format`` does (the engines' llguidance
matcher): the function's parameters, or one of the tools as a ``{"name": ..., "arguments": ...}``
object. ``"auto"`` leaves the model free, and its text is read for the ``<tool_call>`` blocks
that most open chat templates teach (:mod:`gateway.tool_output`). ``"none"`` shows the tools
and reads nothing.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from gateway.errors import bad_request
from slogate import json_output

MAX_TOOLS = 128
"""As at OpenAI."""
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""A function's name, as OpenAI allows it: it is also what the output's ``name`` is held to."""
MAX_CALL_ID_CHARS = 256
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
"""A function without ``parameters`` takes none, as at OpenAI."""
CHOICES = ("none", "auto", "required")


class Function(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    """Accepted: a named or required call is held to its parameters whatever it says."""


class Tool(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    function: Function | None = None
    """Optional here so that another ``type`` (OpenAI's custom tools) is refused for its type."""


class ChosenFunction(msgspec.Struct, forbid_unknown_fields=True):
    name: str


class ToolChoice(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    function: ChosenFunction | None = None
    allowed_tools: msgspec.Raw = msgspec.field(default_factory=lambda: msgspec.Raw(b"null"))
    custom: msgspec.Raw = msgspec.field(default_factory=lambda: msgspec.Raw(b"null"))
    """OpenAI's other choices' fields: known, so that those are refused for their ``type``."""


class CalledFunction(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    arguments: str


class ToolCall(msgspec.Struct, forbid_unknown_fields=True):
    """A call in an earlier answer, as the client sends it back."""

    id: str
    type: str
    function: CalledFunction
    index: int | None = None
    """Accepted and without effect: a streamed call's place, which clients that add up the
    chunks send back with it."""


@dataclass(frozen=True)
class ToolUse:
    """How an answer is read back as tool calls."""

    mode: Literal["auto", "required", "named"]
    names: frozenset[str]
    """The offered functions': ``"auto"`` takes a block naming another for text."""
    name: str | None = None
    """The function a named choice calls."""
    parallel: bool = True
    """Whether the answer may hold more than one call (``parallel_tool_calls``): ``"required"``'s
    schema allows an array of them, and ``"auto"`` reads on past its first."""

    @property
    def ends_at_first_call(self) -> bool:
        """Whether the answer's first call is its last word: under ``"auto"`` without parallel
        calls, what the model writes after it is dropped (``"required"``'s schema holds a lone
        call by itself)."""
        return self.mode == "auto" and not self.parallel


@dataclass
class Offer:
    """A request's tools, checked: what the template shows, how the answer is read back (None:
    as text), and the JSON schema the output is held to, with the field it came from."""

    tools: list[dict[str, Any]]
    use: ToolUse | None
    schema: str | None = None
    schema_param: str | None = None


def offer(tools: list[Tool] | None, choice: str | ToolChoice | None, parallel: bool | None) -> Offer | None:
    """The request's tools and choice, or None where it offers none. Each fault is a 400 naming
    its place (``tools[1].function.name``)."""
    if not tools:
        if choice is not None and choice != "none":
            raise bad_request("'tool_choice' needs 'tools' to choose from", "tool_choice")
        return None
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"at most {MAX_TOOLS} tools are allowed, got {len(tools)}", "tools")
    shown: list[dict[str, Any]] = []
    params: dict[str, tuple[int, dict[str, Any]]] = {}
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise bad_request(f"only tools of type 'function' are supported, got {tool.type!r}",
                              f"tools[{i}].type", "unsupported_value")
        fn = tool.function
        if fn is None:
            raise bad_request("a function tool needs 'function'", f"tools[{i}].function", "missing_required_parameter")
        if not NAME.fullmatch(fn.name):
            raise bad_request("a function's name must be 1 to 64 letters, digits, underscores or dashes",
                              f"tools[{i}].function.name")
        if fn.name in params:
            raise bad_request(f"function name {fn.name!r} is also tools[{params[fn.name][0]}]'s; names must be "
                              "unique", f"tools[{i}].function.name")
        parameters = fn.parameters or NO_PARAMETERS
        if parameters.get("type") != "object":
            raise bad_request("'parameters' must be a JSON schema of type 'object' (\"type\": \"object\"), as a "
                              "call's arguments are an object", f"tools[{i}].function.parameters")
        params[fn.name] = (i, parameters)
        described = {} if fn.description is None else {"description": fn.description}
        shown.append({"type": "function", "function": {"name": fn.name, **described, "parameters": parameters}})
    names = frozenset(params)
    if choice is None or choice == "auto":
        return Offer(shown, ToolUse("auto", names, parallel=parallel is not False))
    if choice == "none":
        return Offer(shown, None)
    if choice == "required":
        calls = [_call_schema(name, i, p) for name, (i, p) in params.items()]
        one = calls[0] if len(calls) == 1 else {"anyOf": calls}
        schema = {"type": "array", "minItems": 1, "items": one} if parallel is not False else one
        return Offer(shown, ToolUse("required", names, parallel=parallel is not False),
                     _schema_text(schema, "tools"), "tools")
    if isinstance(choice, str):
        raise bad_request(f"'tool_choice' must be 'none', 'auto', 'required' or "
                          f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {choice!r}", "tool_choice")
    if choice.type != "function":
        raise bad_request(f"'tool_choice.type' must be 'function', got {choice.type!r}", "tool_choice.type",
                          "unsupported_value")
    if choice.function is None:
        raise bad_request("'tool_choice' needs 'function' with the 'name' of the one to call",
                          "tool_choice.function", "missing_required_parameter")
    if choice.function.name not in params:
        raise bad_request(f"'tool_choice' names function {choice.function.name!r}, which no tool defines",
                          "tool_choice.function.name")
    i, parameters = params[choice.function.name]
    param = f"tools[{i}].function.parameters"
    return Offer(shown, ToolUse("named", names, choice.function.name), _schema_text(parameters, param), param)


def _call_schema(name: str, i: int, parameters: dict[str, Any]) -> dict[str, Any]:
    """One call of function ``name`` as JSON, its name first. The parameters get an ``$id`` of
    their own, so their ``$ref``s (``#/$defs/...``, as pydantic writes them) still resolve
    inside them, nested here, rather than against this schema's root."""
    return {"type": "object", "properties": {"name": {"const": name},
                                             "arguments": {"$id": f"urn:slogate:tools:{i}", **parameters}},
            "required": ["name", "arguments"], "additionalProperties": False}


def _schema_text(schema: dict[str, Any], param: str) -> str:
    text = msgspec.json.encode(schema)
    if len(text) > json_output.MAX_SCHEMA_BYTES:
        raise bad_request(f"'{param}' may be at most {json_output.MAX_SCHEMA_BYTES} bytes as compact JSON, got "
                          f"{len(text)}", param)
    return text.decode()


def called(where: str, calls: list[ToolCall]) -> list[dict[str, Any]]:
    """An earlier answer's calls as chat templates take them: each one's arguments an object,
    as transformers' templates (and vLLM) expect, not the JSON text OpenAI sends."""
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        if call.type != "function":
            raise bad_request(f"only tool calls of type 'function' are supported, got {call.type!r}", f"{at}.type",
                              "unsupported_value")
        if not 0 < len(call.id) <= MAX_CALL_ID_CHARS:
            raise bad_request(f"a tool call's 'id' must be 1 to {MAX_CALL_ID_CHARS} characters", f"{at}.id")
        if not NAME.fullmatch(call.function.name):
            raise bad_request("a function's name must be 1 to 64 letters, digits, underscores or dashes",
                              f"{at}.function.name")
        try:
            arguments = json.loads(call.function.arguments)
        except (ValueError, RecursionError):
            arguments = None
        if not isinstance(arguments, dict):
            raise bad_request("a tool call's 'arguments' must be a JSON object, as text", f"{at}.function.arguments")
        out.append({"id": call.id, "type": "function",
                    "function": {"name": call.function.name, "arguments": arguments}})
    return out
