"""The OpenAI request bodies, and the one place that decides how a body can be wrong.

Bodies are decoded straight into typed structs (msgspec: strict types, one pass, no dict
walking); every failure becomes an :class:`APIError` naming the offending field.
"""

from __future__ import annotations

import asyncio
import codecs
import functools
import math
import re
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec

from gateway import tool_output
from gateway.errors import APIError, bad_request
from gateway.tools import Offer, Tool, ToolCall, ToolChoice, ToolUse, called, offer
from slogate import json_output
from slogate.protocol import SamplingParams

MAX_STOP_STRINGS = 4
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300
MAX_COMPLETION_LOGPROBS = 5
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64

Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
"""Every integer a body carries: what a worker can be sent (the protocol encodes 64-bit
integers), refused here with the field's name rather than failing on the way to Redis."""


NAME = Annotated[str, msgspec.Meta(pattern=r"^[^\s<|\\/>]{1,256}\Z")]
r"""A message's ``name``, as OpenAI allows it (no whitespace, nor any of ``<|\/>``): it reaches
the chat template, so it must not be able to carry a turn's markers. ``\Z``, not ``$``, which
also matches before a final newline."""
MODEL = Annotated[str, msgspec.Meta(max_length=256)]
"""A model id: it goes into the audit trail, whatever model it names."""


def _raw() -> Any:
    """A field only checked for whether it is set (or ignored): kept as its raw JSON, which is
    validated but never built into objects, so a body that fills it costs no more than its
    bytes (a megabyte of empty lists built as Python objects took 22 MB and 70 ms)."""
    return msgspec.field(default_factory=lambda: msgspec.Raw(b"null"))


def _given(raw: msgspec.Raw) -> bool:
    """Whether a raw field holds anything: not null, nor an empty list or object."""
    text = bytes(raw)
    return text != b"null" and not (text[:1] in b"[{" and text[1:].lstrip()[:1] in (b"]", b"}"))


def _is_none(raw: msgspec.Raw) -> bool:
    """Whether a raw field is null or the string "none"."""
    text = bytes(raw)
    if text == b"null":
        return True
    try:
        return len(text) < 16 and msgspec.json.decode(text) == "none"
    except msgspec.DecodeError:  # 1e999: JSON, but beyond a float
        return False


class ContentPart(msgspec.Struct, forbid_unknown_fields=True):
    """Unknown fields are refused by their path, as in :class:`_Common`."""

    type: str
    text: str | None = None
    image_url: msgspec.Raw = _raw()
    input_audio: msgspec.Raw = _raw()
    file: msgspec.Raw = _raw()
    refusal: msgspec.Raw = _raw()
    """The other parts OpenAI has: known, so that one is refused for its ``type``."""
    prompt_cache_breakpoint: msgspec.Raw = _raw()
    """Accepted and without effect: a hint for OpenAI's prompt cache."""
    cache_control: msgspec.Raw = _raw()
    """Accepted and without effect: Anthropic's cache hint, which LiteLLM and OpenRouter clients
    send in OpenAI-shaped requests."""


class Message(msgspec.Struct, forbid_unknown_fields=True):
    """Unknown fields are refused by their path, as in :class:`_Common`."""

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: NAME | None = None
    tool_calls: list[ToolCall] | None = None
    function_call: msgspec.Raw = _raw()
    """The deprecated form of ``tool_calls``: refused when set."""
    refusal: str | None = None
    """An earlier answer's refusal: refused when set, as it would not reach the prompt."""
    audio: msgspec.Raw = _raw()
    """An earlier answer's audio: refused when set."""
    tool_call_id: str | None = None
    """Which call a ``tool`` message answers; accepted and without effect on other roles."""
    reasoning_content: msgspec.Raw = _raw()
    reasoning: msgspec.Raw = _raw()
    annotations: msgspec.Raw = _raw()
    cache_control: msgspec.Raw = _raw()
    """Accepted and without effect: what other servers' answers carry (vLLM's and DeepSeek's
    reasoning, OpenAI's citations) and clients send back with the history, and Anthropic's
    cache hint. A model's earlier reasoning stays out of the prompt, as chat templates leave it."""


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    """Unknown fields are refused by their path, as in :class:`_Common`."""

    include_usage: bool = False
    continuous_usage_stats: bool = False
    """vLLM's extension: usage (tokens so far) on every chunk, not only after the last."""
    include_obfuscation: bool = False
    """Accepted and without effect: OpenAI's padding of chunks against length side channels."""


class JsonSchemaFormat(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None
    """Accepted: the output is held to the schema whatever it says."""


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    json_schema: JsonSchemaFormat | None = None


class _Common(msgspec.Struct, forbid_unknown_fields=True):
    """A parameter this gateway does not know is refused by name, not ignored: a client that
    asks for constrained output (``guided_json``) or a sampler this gateway lacks must not get
    an answer that silently lacks it."""

    model: MODEL
    max_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: Int64 | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    top_k: Int64 | None = None
    min_tokens: Int64 | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[Int64] | None = None
    logprobs: bool | Int64 | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    metadata: msgspec.Raw = _raw()
    store: bool | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    """Accepted and without effect here: bookkeeping for OpenAI's platform, and (tool calls)
    moot without tools."""


class ChatBody(_Common):
    messages: list[Message] = msgspec.field(default_factory=list)
    max_completion_tokens: Int64 | None = None
    tools: list[Tool] | None = None
    tool_choice: str | ToolChoice | None = None
    functions: msgspec.Raw = _raw()
    """The deprecated form of ``tools``: refused when set."""
    function_call: msgspec.Raw = _raw()
    top_logprobs: Int64 | None = None
    modalities: list[str] | None = None
    audio: msgspec.Raw = _raw()


class CompletionBody(_Common):
    prompt: str | list[Any] | None = None
    tools: msgspec.Raw = _raw()
    """Refused when set: a completion has no chat template to show them."""
    echo: bool | None = None
    suffix: str | None = None
    best_of: Int64 | None = None


@dataclass
class ParsedRequest:
    """A validated request, reduced to what the rest of the gateway needs."""

    kind: Literal["chat", "completion"]
    model: str
    stream: bool
    include_usage: bool
    sampling: SamplingParams
    max_tokens_given: bool
    max_tokens_param: str = "max_tokens"
    """Which of ``max_tokens`` and ``max_completion_tokens`` the client set, for errors to name."""
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    continuous_usage: bool = False
    """Usage on every streamed chunk (``stream_options.continuous_usage_stats`` with
    ``include_usage``)."""
    n: int = 1
    """Choices to answer with, each sampled on its own (:mod:`gateway.choices`)."""
    tools: list[dict[str, Any]] | None = None
    """The functions the chat template shows the model."""
    tool_use: ToolUse | None = None
    """How the answer is read back as tool calls; None: as text."""
    tool_chars: int = 0
    """The prompt's characters beside the messages' content: the tools and earlier calls, as JSON."""

    @property
    def prompt_chars(self) -> int:
        if self.messages is not None:
            return sum(len(m["content"]) for m in self.messages) + self.tool_chars
        return len(self.prompt or "")


_decoders = {"chat": msgspec.json.Decoder(ChatBody), "completion": msgspec.json.Decoder(CompletionBody)}
_CHECKED_MAX = 1024
_checked: OrderedDict[bytes, str | None] = OrderedDict()
"""What :func:`check_json_schema` found of the schemas it compiled last (None: it compiles)."""
_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_AT = re.compile(r" - at `\$\.?(.*)`$")
_MISSING = re.compile(r"missing required field `([^`]+)`")
_UNKNOWN = re.compile(r"unknown field `([^`]+)`")
_AT_BYTE = re.compile(r"\(byte (\d+)\)$")
_BOMS = (codecs.BOM_UTF8, codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)


def parse(kind: Literal["chat", "completion"], body: bytes, default_max_tokens: int,
          max_messages: int = 256, max_n: int = 8) -> ParsedRequest:
    if not body.strip():
        raise bad_request("request body is empty; send a JSON object", code="invalid_json")
    try:
        raw = _decoders[kind].decode(body)
    except msgspec.ValidationError as exc:
        raise _validation_error(str(exc)) from None
    except RecursionError:
        raise bad_request("request body is nested too deeply", code="invalid_json") from None
    except msgspec.DecodeError as exc:
        text = str(exc)
        if "UTF-8" in text:
            raise bad_request("request body is not valid UTF-8", code="invalid_encoding") from None
        if body.startswith(_BOMS):  # invisible in an editor: 'invalid character (byte 0)' would point at a '{'
            raise bad_request("request body starts with a byte order mark; send UTF-8 JSON without one",
                              code="invalid_encoding") from None
        raise bad_request(f"request body is not valid JSON: {_json_error(kind, body, text)}",
                          code="invalid_json") from None
    if isinstance(raw, ChatBody) and len(raw.messages) > max_messages:
        raise bad_request(f"at most {max_messages} messages are allowed, got {len(raw.messages)}", "messages")
    return _check(kind, raw, default_max_tokens, max_n)


_TRUNCATED = "Input data was truncated"
_ROOM = b" " * 6
"""What msgspec reads ahead of a high surrogate's escape (``\\ud83d``) for its low one."""


def _json_error(kind: str, body: bytes, text: str) -> str:
    """msgspec's error, or the one it hides: a body whose last string ends in a lone high
    surrogate (half an emoji, as ``JSON.stringify`` escapes it) has fewer than six bytes after
    it in the usual chat body (``"}]}``), and msgspec calls such a body truncated. Decoded
    again with room after it, the error is the surrogate's if it lies in the body, not in the
    room (a body cut short stays truncated)."""
    if text != _TRUNCATED:
        return text
    try:
        _decoders[kind].decode(body + _ROOM)
    except msgspec.DecodeError as exc:
        at = _AT_BYTE.search(str(exc))
        if at and int(at[1]) < len(body):
            return str(exc)
    except msgspec.ValidationError:
        pass
    return text


def _validation_error(text: str) -> APIError:
    at = _AT.search(text)
    unknown = _UNKNOWN.search(text)
    if unknown:
        name = f"{at.group(1)}.{unknown.group(1)}" if at and at.group(1) else unknown.group(1)
        return bad_request(f"unknown parameter '{name}': this gateway does not support it", name,
                           "unsupported_parameter")
    missing = _MISSING.search(text)
    if missing:
        where = at.group(1) if at else ""
        param = f"{where}.{missing.group(1)}" if where else missing.group(1)
        return bad_request(f"missing required field '{param}'", param, "missing_required_parameter")
    if at:
        param = at.group(1) or None
        return bad_request(f"invalid value for '{param}': {text[:at.start()]}", param, "invalid_type")
    return bad_request(f"invalid request body: {text}", None, "invalid_type")


def _check(kind: str, raw: ChatBody | CompletionBody, default_max_tokens: int, max_n: int) -> ParsedRequest:
    if not raw.model:
        raise bad_request("'model' must be a non-empty string", "model")
    n = 1 if raw.n is None else raw.n
    if not 1 <= n <= max_n:
        raise bad_request(f"'n' must be from 1 to {max_n} (choices to answer with), got {n}", "n")
    tools: Offer | None = None
    if isinstance(raw, CompletionBody) and _given(raw.tools):
        raise bad_request("tools are for chat completions (/v1/chat/completions)", "tools", "unsupported_value")
    if isinstance(raw, ChatBody):
        if _given(raw.functions) or not _is_none(raw.function_call):
            raise bad_request("'functions' and 'function_call' are the deprecated forms of 'tools' and "
                              "'tool_choice': send those", "functions" if _given(raw.functions) else "function_call",
                              "unsupported_value")
        tools = offer(raw.tools, raw.tool_choice, raw.parallel_tool_calls)
        audio = bytes(raw.audio) != b"null"
        if raw.modalities not in (None, ["text"]) or audio:
            raise bad_request("only text output is supported by this gateway",
                              "audio" if audio else "modalities", "unsupported_value")
    if raw.stream_options is not None and not raw.stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
    temperature = _ranged(raw.temperature, "temperature", 0.0, 2.0, 1.0)
    top_p = _ranged(raw.top_p, "top_p", 0.0, 1.0, 1.0)
    if top_p == 0.0:
        raise bad_request("'top_p' must be greater than 0", "top_p")
    presence = _ranged(raw.presence_penalty, "presence_penalty", -2.0, 2.0, 0.0)
    frequency = _ranged(raw.frequency_penalty, "frequency_penalty", -2.0, 2.0, 0.0)
    if raw.top_k is not None and raw.top_k < -1:
        raise bad_request("'top_k' must be positive, or 0 or -1 to disable it", "top_k")
    stops = [raw.stop] if isinstance(raw.stop, str) else list(raw.stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop sequences are allowed", "stop")
    if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise bad_request(f"stop sequences must be 1 to {MAX_STOP_CHARS} characters", "stop")

    max_tokens = raw.max_tokens
    param = "max_tokens"
    if isinstance(raw, ChatBody) and raw.max_completion_tokens is not None:
        max_tokens, param = raw.max_completion_tokens, "max_completion_tokens"
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"'{param}' must be at least 1, got {max_tokens}", param)
    min_tokens = raw.min_tokens or 0
    if min_tokens < 0 or min_tokens > (max_tokens or default_max_tokens):
        raise bad_request(f"'min_tokens' must be between 0 and {param} ({max_tokens or default_max_tokens}"
                          f"{'' if max_tokens else ', the default'})", "min_tokens")
    stop_ids = raw.stop_token_ids or []
    if len(stop_ids) > MAX_STOP_TOKEN_IDS or any(not 0 <= i < 2**31 for i in stop_ids):
        raise bad_request(f"'stop_token_ids' must hold at most {MAX_STOP_TOKEN_IDS} token ids, each from 0 "
                          f"to {2**31 - 1}", "stop_token_ids")

    json_schema = _json_schema(raw.response_format)
    schema_param = None
    if tools is not None and tools.use is not None:
        if json_schema is not None:
            raise bad_request("a JSON 'response_format' cannot be combined with 'tools' unless 'tool_choice' is "
                              "'none': the answer would be tool calls or that JSON, not both", "response_format",
                              "unsupported_value")
        json_schema, schema_param = tools.schema, tools.schema_param
        stops = tool_output.stops(tools.use, stops)
    if json_schema is not None and (stops or stop_ids):
        held_to = ("a JSON 'response_format'" if schema_param is None
                   else "'tool_choice' 'required' or a named function")
        raise bad_request(f"'stop' and 'stop_token_ids' cannot be combined with {held_to}: they would "
                          "cut the JSON short; it ends by itself when complete",
                          "stop" if stops else "stop_token_ids", "unsupported_value")
    sampling = SamplingParams(
        max_tokens=max_tokens or default_max_tokens, max_tokens_default=max_tokens is None,
        temperature=temperature, top_p=top_p,
        top_k=max(raw.top_k or 0, 0), seed=raw.seed, stop=stops, stop_token_ids=stop_ids,
        ignore_eos=bool(raw.ignore_eos), min_tokens=min_tokens, presence_penalty=presence,
        frequency_penalty=frequency, logprobs=_logprobs(raw), logit_bias=_logit_bias(raw.logit_bias),
        json_schema=json_schema, schema_param=schema_param)
    parsed = ParsedRequest(
        kind="chat" if isinstance(raw, ChatBody) else "completion", model=raw.model,
        stream=bool(raw.stream), include_usage=bool(raw.stream_options and raw.stream_options.include_usage),
        sampling=sampling, max_tokens_given=max_tokens is not None, max_tokens_param=param,
        continuous_usage=bool(raw.stream_options and raw.stream_options.include_usage
                              and raw.stream_options.continuous_usage_stats), n=n)
    if isinstance(raw, ChatBody):
        parsed.messages = _messages(raw.messages)
        if tools is not None:
            parsed.tools, parsed.tool_use = tools.tools, tools.use
        parsed.tool_chars = _tool_chars(parsed)
    else:
        parsed.prompt = _prompt(raw, n)
    return parsed


def _logprobs(raw: ChatBody | CompletionBody) -> int | None:
    """How many likeliest tokens each sampled token's log-probability comes with; None: no
    log-probabilities. Chat asks with ``logprobs: true`` and ``top_logprobs`` (0-20), completions
    with ``logprobs`` alone (0-5), as OpenAI has them."""
    if isinstance(raw, CompletionBody):
        if raw.logprobs is None:
            return None
        if isinstance(raw.logprobs, bool) or not 0 <= raw.logprobs <= MAX_COMPLETION_LOGPROBS:
            raise bad_request(f"'logprobs' must be an integer from 0 to {MAX_COMPLETION_LOGPROBS} (how many "
                              f"likeliest tokens to list at each place), got {raw.logprobs}", "logprobs")
        return raw.logprobs
    if raw.logprobs is not None and not isinstance(raw.logprobs, bool):
        raise bad_request("'logprobs' must be true or false for chat completions (how many likeliest tokens to "
                          "list is 'top_logprobs')", "logprobs")
    top = raw.top_logprobs
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise bad_request(f"'top_logprobs' must be from 0 to {MAX_TOP_LOGPROBS}, got {top}", "top_logprobs")
    if top and not raw.logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if raw.logprobs else None


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """Token id (a decimal string, as JSON keys are) -> what to add to its logit, -100 to 100."""
    if not bias:
        return {}
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad_request(f"'logit_bias' may bias at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}", "logit_bias")
    out = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10) or int(key) >= 2**31:
            shown = key if len(key) <= 24 else key[:24] + "..."
            raise bad_request(f"'logit_bias' keys must be token ids (0 to {2**31 - 1}, as strings), got {shown!r}",
                              "logit_bias")
        if not math.isfinite(value) or not -100 <= value <= 100:
            raise bad_request(f"'logit_bias' values must be from -100 to 100, got {value} for token {key}",
                              "logit_bias")
        out[int(key)] = float(value)
    return out


def _json_schema(fmt: ResponseFormat | None) -> str | None:
    """The JSON schema (as JSON text) that ``response_format`` holds the output to, or None for
    free text; whether it compiles is :func:`check_json_schema`'s question."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return json_output.ANY_OBJECT
    if fmt.type != "json_schema":
        raise bad_request(f"response_format type must be 'text', 'json_object' or 'json_schema', got {fmt.type!r}",
                          "response_format.type", "unsupported_value")
    spec = fmt.json_schema
    if spec is None:
        raise bad_request("response_format 'json_schema' needs a 'json_schema' object with its 'name' and "
                          "'schema'", "response_format.json_schema", "missing_required_parameter")
    if not _SCHEMA_NAME.fullmatch(spec.name):
        raise bad_request("'response_format.json_schema.name' must be 1 to 64 letters, digits, underscores or "
                          "dashes", "response_format.json_schema.name")
    if spec.schema is None:
        return json_output.ANY_VALUE
    schema = msgspec.json.encode(spec.schema)
    if len(schema) > json_output.MAX_SCHEMA_BYTES:
        raise bad_request(f"'response_format.json_schema.schema' may be at most {json_output.MAX_SCHEMA_BYTES} "
                          f"bytes as compact JSON, got {len(schema)}", "response_format.json_schema.schema")
    return schema.decode()


@functools.cache
def _compiler() -> ThreadPoolExecutor:
    return json_output.compiler("schema-check")


async def check_json_schema(parsed: ParsedRequest) -> None:
    """Refuse a JSON schema that cannot compile, before anything is queued. It compiles on a
    thread of its own (llguidance lets go of the GIL; the thread's stack is deep enough for its
    recursion): a 64 KB schema can take 0.2 s, which on the event loop would stall every stream
    this gateway serves. Apps send the same few schemas, so each verdict is kept, by digest."""
    text = parsed.sampling.json_schema
    param = parsed.sampling.schema_param or "response_format.json_schema.schema"
    if text is None or text == json_output.ANY_OBJECT:
        return
    key = json_output.digest(text)
    if key in _checked:
        _checked.move_to_end(key)
        error = _checked[key]
    else:
        error = await asyncio.get_running_loop().run_in_executor(_compiler(), json_output.schema_error, text)
        _checked[key] = error
        if len(_checked) > _CHECKED_MAX:
            _checked.popitem(last=False)
    if error is not None:
        raise bad_request(f"'{param}' is not a schema output can be held to: {error}", param)


def _ranged(value: float | None, name: str, lo: float, hi: float, default: float) -> float:
    if value is None:
        return default
    if not math.isfinite(value) or not lo <= value <= hi:
        raise bad_request(f"'{name}' must be between {lo:g} and {hi:g}, got {value}", name)
    return float(value)


def _messages(messages: list[Message]) -> list[dict[str, Any]]:
    if not messages:
        raise bad_request("'messages' must hold at least one message", "messages", "missing_required_parameter")
    out = []
    call_ids: set[str] = set()
    for i, m in enumerate(messages):
        if _given(m.function_call):
            raise bad_request("'function_call' is the deprecated form of 'tool_calls': send that",
                              f"messages[{i}].function_call", "unsupported_value")
        extra: dict[str, Any] = {} if m.name is None else {"name": m.name}
        if m.tool_calls:
            if m.role != "assistant":
                raise bad_request(f"only an assistant message may hold 'tool_calls', not a {m.role} message",
                                  f"messages[{i}].tool_calls")
            extra["tool_calls"] = called(f"messages[{i}].tool_calls", m.tool_calls)
            call_ids.update(c["id"] for c in extra["tool_calls"])
        if m.role == "tool":
            if m.tool_call_id is None:
                raise bad_request("a tool message needs 'tool_call_id', the id of the call it answers",
                                  f"messages[{i}].tool_call_id", "missing_required_parameter")
            if m.tool_call_id not in call_ids:
                raise bad_request(f"tool message answers call {m.tool_call_id[:64]!r}, which no earlier assistant "
                                  "message's 'tool_calls' made", f"messages[{i}].tool_call_id")
            extra["tool_call_id"] = m.tool_call_id
        if m.refusal:
            raise bad_request("a refusal in an earlier answer is not supported by this gateway; send its text as "
                              "'content'", f"messages[{i}].refusal", "unsupported_value")
        if _given(m.audio):
            raise bad_request("only text output is supported by this gateway", f"messages[{i}].audio",
                              "unsupported_value")
        if m.content is None and m.role != "assistant":
            raise bad_request(f"a {m.role} message needs 'content'", f"messages[{i}].content",
                              "missing_required_parameter")
        if isinstance(m.content, list):
            texts = []
            for j, part in enumerate(m.content):
                if part.type != "text":
                    raise bad_request(f"only text content parts are supported, got '{part.type}'",
                                      f"messages[{i}].content[{j}].type", "unsupported_value")
                if part.text is None:
                    raise bad_request("a text content part needs 'text'", f"messages[{i}].content[{j}].text",
                                      "missing_required_parameter")
                texts.append(part.text)
            content = "".join(texts)
        else:
            content = m.content or ""
        out.append({"role": m.role, "content": content, **extra})
    return out


def _tool_chars(parsed: ParsedRequest) -> int:
    """What the chat template adds for tools and earlier calls, as its JSON's length: the
    prompt's size beside the messages' content, which a prompt's tokens are estimated from."""
    calls = [m["tool_calls"] for m in parsed.messages or () if "tool_calls" in m]
    return sum(len(msgspec.json.encode(part)) for part in (parsed.tools, calls) if part)


def _prompt(raw: CompletionBody, n: int) -> str:
    if raw.echo:
        raise bad_request("echo is not supported by this gateway", "echo", "unsupported_value")
    if raw.suffix:
        raise bad_request("suffix is not supported by this gateway", "suffix", "unsupported_value")
    if raw.best_of not in (None, n):
        raise bad_request(f"only best_of={n} (equal to n) is supported: the best of more samples than it "
                          f"returns is not", "best_of", "unsupported_value")
    prompt = raw.prompt
    if prompt is None:
        raise bad_request("missing required field 'prompt'", "prompt", "missing_required_parameter")
    if isinstance(prompt, list):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise bad_request("'prompt' must be a string or a list of exactly one string "
                              "(batched and token-id prompts are not supported)", "prompt", "unsupported_value")
        prompt = prompt[0]
    if not prompt:
        raise bad_request("'prompt' must not be empty", "prompt")
    return prompt
