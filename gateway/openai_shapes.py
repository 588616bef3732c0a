"""OpenAI's response and stream-chunk shapes, for chat and legacy completions."""

from __future__ import annotations

import codecs
from typing import Any

import msgspec

from slogate.protocol import TokenLogprob

_json = msgspec.json.Encoder()


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response_id(kind: str, request_id: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{request_id}"


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    return {"content": [{"token": e.token, "logprob": e.logprob, "bytes": list(e.raw),
                         "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(raw)} for t, raw, lp in e.top]}
                        for e in entries],
            "refusal": None}


class TextOffsets:
    """Where each token starts in the completion, in characters, from the tokens' bytes: a
    token inside a character starts where that character does."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._chars = 0

    def __call__(self, raw: bytes) -> int:
        start = self._chars
        unfinished = self._decoder.getstate()[0]
        if unfinished and raw and not _continues(unfinished + raw[:1]):  # a U+FFFD of its own, before this token
            start += len(unfinished.decode("utf-8", "replace"))
        self._chars += len(self._decoder.decode(raw))
        return start


_SECOND_BYTE = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}
"""Lead bytes whose second byte has a narrower range than 80-BF (Unicode's table 3-7)."""


def _continues(prefix: bytes) -> bool:
    """Whether ``prefix`` is the start of a well-formed UTF-8 character. Python's incremental
    decoder holds some ill-formed pairs (ED A0) until a third byte, though the text it finally
    gives has a U+FFFD for each of their bytes: the check is the standard's, not the decoder's."""
    lead = prefix[0]
    if 0xC2 <= lead <= 0xDF:
        length = 2
    elif 0xE0 <= lead <= 0xEF:
        length = 3
    elif 0xF0 <= lead <= 0xF4:
        length = 4
    else:
        return len(prefix) == 1 and lead < 0x80
    low, high = _SECOND_BYTE.get(lead, (0x80, 0xBF))
    return (len(prefix) <= length and (len(prefix) < 2 or low <= prefix[1] <= high)
            and all(0x80 <= b <= 0xBF for b in prefix[2:]))


def _legacy_token(token: str, raw: bytes) -> str:
    """A token that is not whole UTF-8 text named by its bytes (``bytes:\\xe9\\xa3``), as
    OpenAI's completions name them: completions carry no bytes of their own, and ``top_logprobs``
    is keyed by token, where every such token would otherwise be the same U+FFFD."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    return token


def completion_logprobs(entries: list[TokenLogprob], offsets: TextOffsets | None = None) -> dict[str, Any]:
    """``offsets``: the completion's so far, for a stream's chunk after the first."""
    offsets = offsets or TextOffsets()
    tokens = [_legacy_token(e.token, e.raw) for e in entries]
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [_top(token, e) for token, e in zip(tokens, entries)],
            "text_offset": [offsets(e.raw) for e in entries]}


def _top(token: str, entry: TokenLogprob) -> dict[str, float]:
    """The sampled token and its alternatives by name: where two share a name, the sampled one's
    figure, else the likelier's, stands."""
    top = {token: entry.logprob}
    for text, raw, logprob in entry.top:
        top.setdefault(_legacy_token(text, raw), logprob)
    return top


def choice(kind: str, index: int, text: str | None, finish_reason: str,
           logprobs: list[TokenLogprob] | None = None, calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One of a response's choices; ``logprobs``: None when the request did not ask for them;
    ``calls``: a chat answer's tool calls, if any (its content then None where it is only them)."""
    if kind == "chat":
        message = {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}
        return {"index": index, "message": message,
                "logprobs": None if logprobs is None else chat_logprobs(logprobs), "finish_reason": finish_reason}
    return {"index": index, "text": text, "logprobs": None if logprobs is None else completion_logprobs(logprobs),
            "finish_reason": finish_reason}


def full_response(kind: str, rid: str, created: int, model: str, choices: list[dict[str, Any]],
                  use: dict[str, int]) -> bytes:
    return _json.encode({"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
                         "created": created, "model": model, "choices": choices, "usage": use})


class ChunkWriter:
    """Builds the SSE frames of one choice (``index``) of a streamed response."""

    def __init__(self, kind: str, rid: str, created: int, model: str, index: int = 0) -> None:
        self.kind = kind
        self.index = index
        self.offsets = TextOffsets()
        """Where the tokens start in the completion (for completions' log-probabilities)."""
        self.head = {"id": rid, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
                     "created": created, "model": model}

    def _frame(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return b"data: " + _json.encode({**self.head, "choices": choices, **extra}) + b"\n\n"

    def role(self) -> bytes:
        return self._frame([{"index": self.index, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}])

    def text(self, text: str, use: dict[str, int] | None = None, logprobs: list[TokenLogprob] | None = None) -> bytes:
        """``logprobs``: the chunk's tokens', or None when the request did not ask for them."""
        if self.kind == "chat":
            return self.delta({"content": text}, use, logprobs)
        extra = {} if use is None else {"usage": use}
        shown = None if logprobs is None else completion_logprobs(logprobs, self.offsets)
        return self._frame([{"index": self.index, "text": text, "logprobs": shown, "finish_reason": None}], **extra)

    def delta(self, delta: dict[str, Any], use: dict[str, int] | None = None,
              logprobs: list[TokenLogprob] | None = None) -> bytes:
        """A chat chunk of ``delta``: content, or a tool call's start or more of its arguments."""
        return self._frame([{"index": self.index, "delta": delta,
                             "logprobs": None if logprobs is None else chat_logprobs(logprobs),
                             "finish_reason": None}], **({} if use is None else {"usage": use}))

    def finish(self, finish_reason: str, logprobs: list[TokenLogprob] | None = None) -> bytes:
        """``logprobs``: of tokens no chunk has carried yet (held back as a tool call's text)."""
        if self.kind == "chat":
            return self._frame([{"index": self.index, "delta": {},
                                 "logprobs": None if logprobs is None else chat_logprobs(logprobs),
                                 "finish_reason": finish_reason}])
        return self._frame([{"index": self.index, "text": "", "logprobs": None, "finish_reason": finish_reason}])

    def usage(self, use: dict[str, int]) -> bytes:
        return self._frame([], usage=use)


def sse_error(body: dict[str, Any]) -> bytes:
    return b"data: " + _json.encode(body) + b"\n\n"


DONE = b"data: [DONE]\n\n"
KEEP_ALIVE = b": keep-alive\n\n"
"""An SSE comment: clients skip it, and proxies see the connection in use."""
