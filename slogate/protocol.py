"""The messages that cross Redis between gateways and workers.

Both sides import this one module. Every message carries ``v``; a reader that meets another
version raises :class:`ProtocolError` instead of guessing, so a gateway and a worker of
different releases fail loudly. Messages are msgpack (via msgspec) in the field ``m`` of a
stream entry: compact, and an order of magnitude faster to encode than JSON.
"""

from __future__ import annotations

from typing import Any, Literal, Union

import msgspec

VERSION = 2
"""2: reply entries hold a batch of records (:data:`BATCH_FIELD`), so a worker of this release
refuses a request from a gateway of the last one instead of answering in a shape it cannot
read."""
FIELD = b"m"
ID_FIELD = b"id"
"""Every request entry carries its request id in the clear: it routes the request and is
what a sealed message is bound to."""
REPLY_FIELD = b"r"
"""A request entry's reply stream, in the clear too: a worker that cannot read the message (a
key it lacks, another release) still answers it there, at once, instead of leaving its client
to wait for its deadline (an hour for batch)."""
BATCH_FIELD = b"b"
"""A reply entry holds the records one worker wrote for one gateway at once: msgpack pairs
(request id in the clear, message), in the order written. One entry per write instead of one
per record: at 16 streams a step's records cost one XADD instead of 16, and packing those
commands and parsing their replies took 40% of a worker's event loop."""

FinishReason = Literal["stop", "length", "cancelled", "deadline", "error"]


class ProtocolError(ValueError):
    """A message that this release cannot read (wrong version or malformed)."""


GREEDY_BELOW = 1e-5
"""A temperature below this samples greedily (the argmax)."""


class SamplingParams(msgspec.Struct, omit_defaults=True):
    max_tokens: int = 16
    max_tokens_default: bool = False
    """``max_tokens`` is the gateway's default, not the client's: a cap, which a prompt that
    leaves less room in the context lowers to what it leaves (:func:`fit_to_context`), where a
    ``max_tokens`` the client asked for is refused with a 400."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    """None: no log-probabilities; k: each sampled token's, with the k likeliest at its place."""
    logit_bias: dict[int, float] = {}
    """Added to a token's logit before sampling (OpenAI's ``logit_bias``, by token id)."""
    json_schema: str | None = None
    """JSON schema (as JSON text) that the output must match (``response_format``, or a tool
    call's); the output ends when the JSON is complete. None: free text."""
    schema_param: str | None = None
    """The request field the schema came from, which an error about it names. None:
    ``response_format``'s."""

    @property
    def deterministic(self) -> bool:
        """Whether a rerun reproduces the same tokens (what makes a retry invisible)."""
        return self.temperature < GREEDY_BELOW or self.seed is not None


FEATURES = ("logprobs", "logit_bias", "response_format", "tools")
"""The request parameters (by their OpenAI names) a worker of this release reads that the
first releases of this protocol version did not: those ignore them, unknown fields of a
message being skipped. A worker says which it reads in its heartbeat, so that a gateway
refuses a request that needs one a worker serving its model would ignore."""


def features_needed(sampling: SamplingParams, tools: bool = False) -> list[str]:
    """The :data:`FEATURES` a request with ``sampling`` (and ``tools``, if it offers any) would be
    answered wrongly without. A schema of a tool call is the tools' need, not the
    ``response_format``'s."""
    return [name for name, given in (("logprobs", sampling.logprobs is not None),
                                     ("logit_bias", bool(sampling.logit_bias)),
                                     ("response_format", sampling.json_schema is not None and not tools),
                                     ("tools", tools)) if given]


def fit_to_context(sampling: SamplingParams, prompt_tokens: int, max_context: int) -> SamplingParams:
    """``sampling`` with a default ``max_tokens`` lowered to what the context leaves after the
    prompt (at least ``min_tokens``, or it stays, for the engine to refuse): a client that set
    no limit must not be refused for a limit it never asked for."""
    room = max_context - prompt_tokens
    if not sampling.max_tokens_default or sampling.max_tokens <= room or room < max(1, sampling.min_tokens):
        return sampling
    return msgspec.structs.replace(sampling, max_tokens=room)


class GenerateRequest(msgspec.Struct, tag="req", omit_defaults=True):
    id: str
    model: str
    pool: str
    cls: str
    sampling: SamplingParams
    deadline: float
    """Absolute unix time after which nobody waits for the answer."""
    enqueued_at: float
    reply: str
    """The stream the worker appends this request's records to (its gateway's)."""
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    """The functions the model may call, for the chat template to show it (OpenAI's shape)."""
    stream: bool = False
    """Whether the client reads tokens as they come; if not, the worker sends the text once."""
    trace: dict[str, str] = {}
    alive: str | None = None
    """The key its gateway keeps set while it runs (``keys.alive``); a worker stops the request
    once the key is gone. None: no key to watch (a gateway that does not set one)."""
    request_id: str | None = None
    """The gateway's request id (the client's ``x-request-id``), which the gateway's log lines
    about the request carry: a worker's carry it too, so one request can be followed in both."""
    v: int = VERSION


class TokenLogprob(msgspec.Struct, array_like=True):
    """A sampled token's log-probability under the model (before temperature, penalties or
    filters), with its text and exact bytes (a token may be part of a character), and the
    likeliest tokens at its place as (text, bytes, log-probability), likeliest first."""

    token: str
    raw: bytes
    logprob: float
    top: list[tuple[str, bytes, float]] = []


class Delta(msgspec.Struct, tag="delta", omit_defaults=True):
    """New output. ``offset`` is where ``text`` starts in the whole completion, ``attempt``
    which delivery of the request produced it: together they let the gateway drop what a
    retry on another worker repeats, so a client never sees a token twice."""

    text: str
    offset: int
    attempt: int = 1
    prompt_tokens: int = 0
    completion_tokens: int = 0
    """Tokens sampled when ``text`` was sent, so a client can see how many each chunk carries
    (a token inside a UTF-8 character or a held stop string adds no text of its own)."""
    logprobs: list[TokenLogprob] = []
    """For a request that asked for them: the tokens sampled since the last delta, each one's,
    from token ``token_offset`` of the completion on (what a retry repeats is dropped by it)."""
    token_offset: int = 0
    v: int = VERSION


class Final(msgspec.Struct, tag="final", omit_defaults=True):
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    attempt: int = 1
    queue_wait_s: float = 0.0
    ttft_s: float = 0.0
    offset: int = 0
    """Where the completion's text ends, as a delta's ``offset`` says where its text starts:
    a text record lost before a final record that carries no text of its own shows by it."""
    token_offset: int = 0
    """Where its log-probabilities end, likewise."""
    v: int = VERSION


class Error(msgspec.Struct, tag="error", omit_defaults=True):
    """A request that failed. ``status`` is the HTTP status the gateway should answer with."""

    message: str
    code: str
    status: int = 500
    attempt: int = 1
    param: str | None = None
    """The request field at fault, where the worker knows it."""
    v: int = VERSION


class ModelInfo(msgspec.Struct, omit_defaults=True):
    id: str
    max_context: int


class Heartbeat(msgspec.Struct, omit_defaults=True):
    """What a worker publishes about itself, under a key that expires when it stops."""

    worker_id: str
    pool: str
    engine: str
    models: list[ModelInfo]
    running: int
    waiting: int
    capacity: int
    kv_usage: float = 0.0
    prefill_s_per_token: float = 0.0
    decode_step_s: float = 0.0
    decode_s_per_seq: float = 0.0
    """What one more running request adds to ``decode_step_s``; 0 when the engine does not know."""
    quiet_step_s: float = 0.0
    """The shortest decode step this worker has reported with at most one request running: its
    step when nothing else slows it, by which a request that can never fit is told apart from
    one that meets a busy or contended moment. 0 until it has one."""
    quiet_prefill_s_per_token: float = 0.0
    """The lowest ``prefill_s_per_token`` this worker has reported, likewise. The engine's own
    figure follows slow passes up at once and comes down only as it prefills again: after a
    spell of contention it stayed 4-23x its quiet cost, every prompt of some length looked
    like one that can never fit, and none was let through to bring it down. 0 until it has one."""
    ts: float = 0.0
    held: list[str] | None = None
    """The requests it holds (running, waiting, being prepared), by the first ``HELD_ID_CHARS``
    characters of their ids; None from a release that does not say. A Redis that restarts empty
    loses its queues: a gateway then fails the requests no worker holds, which would otherwise
    wait for their deadlines, and leaves those a worker is running (a request not streamed
    hears nothing until its answer)."""
    ttl_s: float = 0.0
    """How long this heartbeat lives (the worker's own ``heartbeat_ttl_s``, which may differ from
    its gateways'): a gateway that lost sight of it (Redis restarted empty) waits that long for it
    to beat again before it counts what it held as lost. 0 from a release that does not say: the
    gateway's own is assumed."""
    features: list[str] | None = None
    """The :data:`FEATURES` its release reads; None from a release that reads none of them."""
    v: int = VERSION


HELD_ID_CHARS = 12
"""Of a request id (32 hex characters): enough that two held ones never meet (48 bits)."""

Result = Union[Delta, Final, Error]

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(GenerateRequest)
_result_decoder = msgspec.msgpack.Decoder(Result)
_heartbeat_decoder = msgspec.msgpack.Decoder(Heartbeat)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def _decode(decoder: msgspec.msgpack.Decoder, data: bytes) -> Any:
    try:
        msg = decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        version = _peek_version(data)
        if version is not None and version != VERSION:
            raise ProtocolError(f"message version {version}, this release reads {VERSION}") from exc
        raise ProtocolError(f"malformed message: {exc}") from exc
    if msg.v != VERSION:
        raise ProtocolError(f"message version {msg.v}, this release reads {VERSION}")
    return msg


def _peek_version(data: bytes) -> int | None:
    try:
        raw = msgspec.msgpack.decode(data)
    except msgspec.DecodeError:
        return None
    return raw.get("v") if isinstance(raw, dict) else None


def decode_request(data: bytes) -> GenerateRequest:
    return _decode(_request_decoder, data)


def decode_result(data: bytes) -> Result:
    return _decode(_result_decoder, data)


def decode_heartbeat(data: bytes) -> Heartbeat:
    return _decode(_heartbeat_decoder, data)


_batch_decoder = msgspec.msgpack.Decoder(list[tuple[bytes, bytes]])


def encode_batch(records: list[tuple[bytes, bytes]]) -> bytes:
    return _encoder.encode(records)


def decode_batch(data: bytes) -> list[tuple[bytes, bytes]]:
    try:
        return _batch_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"malformed reply entry: {exc}") from exc
