"""OpenAI tool calling, the answer's side: the model's text read back as tool calls, as it comes.

One reader per choice takes the text of each delta and gives what the client is sent: content,
a call's start (its id and name) and its arguments' text, in order. A whole answer is read by
the same reader in one go, so an answer streamed and one sent whole say the same.

- A named function: the output is its arguments (held to its parameters), all of it.
- ``"required"``: the output is ``{"name": ..., "arguments": ...}`` (an array of them with
  parallel calls), compact, its keys in that order: the schema holds it so.
- ``"auto"``: the model's own text, where each ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
  block (Hermes's layout, which Qwen's, Hermes's and most open chat templates teach) naming an
  offered function is a call, and the rest is content. A block that does not parse, or names
  no offered function, stays in the content as written; so does one cut short, unless what it
  holds parses (a model may end its turn before the closing tag). With ``parallel_tool_calls``
  false the first call is the answer's last word: generation stops at its closing tag
  (:func:`stops`), and whatever may still follow it is dropped (the answer finishes with
  ``tool_calls`` all the same, :func:`finish_reason`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from gateway.openai_shapes import ChunkWriter
from gateway.tools import ToolUse
from slogate.protocol import TokenLogprob

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class CallStart:
    index: int
    id: str
    name: str


@dataclass
class Arguments:
    index: int
    text: str


Event = str | CallStart | Arguments
"""Content (a str), a call's start, or more of its arguments."""


def call_id() -> str:
    """As OpenAI's look: ``call_`` and 24 characters."""
    return "call_" + os.urandom(12).hex()


class _Named:
    """The call starts before its first text, so a client has its id and name at once; an
    answer without text (cut at once) still has its call, with empty arguments."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls = 0

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = self.end()
        return out + [Arguments(0, text)] if text else out

    def end(self) -> list[Event]:
        if self.calls:
            return []
        self.calls = 1
        return [CallStart(0, call_id(), self.name)]


class _Required:
    """Reads the compact JSON the schema holds the output to: ``{"name":"N","arguments":{...}}``,
    or an array of such objects. A name is sent whole once the key after it has come; arguments
    as they come, until the object they open closes."""

    _NAME_KEY, _ARGUMENTS_KEY = '{"name":"', '","arguments":'

    def __init__(self) -> None:
        self.calls = 0
        self._head = ""
        """What came since the last call's arguments: brackets, the keys, the name."""
        self._in_arguments = False
        self._depth = 0
        self._in_string = self._escaped = False

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        start = 0
        for k, ch in enumerate(text):
            if self._in_arguments:
                self._arguments_char(ch)
                if not self._depth:
                    out.append(Arguments(self.calls - 1, text[start:k + 1]))
                    self._in_arguments = False
                continue
            self._head += ch
            if self._head.endswith(self._ARGUMENTS_KEY):
                name = self._head[self._head.rfind(self._NAME_KEY) + len(self._NAME_KEY):-len(self._ARGUMENTS_KEY)]
                out.append(CallStart(self.calls, call_id(), name))
                self.calls += 1
                self._head = ""
                self._in_arguments = True
                start = k + 1
        if self._in_arguments and start < len(text):
            out.append(Arguments(self.calls - 1, text[start:]))
        return out

    def _arguments_char(self, ch: str) -> None:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                self._in_string = False
        elif ch == '"':
            self._in_string = True
        elif ch in "{[":
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1

    def end(self) -> list[Event]:
        return []


class _Auto:
    """Holds back what may yet be a block: text from an opening tag on until its closing one,
    the end of the text while it could be the start of an opening tag, and whitespace, which
    between blocks or around them is none of the content. Without calls, the content is the
    text as it came. Without parallel calls, nothing is read after the first call."""

    def __init__(self, names: frozenset[str], parallel: bool = True) -> None:
        self.names = names
        self.parallel = parallel
        self.calls = 0
        self._held = ""
        self._in_block = False
        self._gap = ""
        """The whitespace before the block being read: content again if it is no call."""
        self._after_call = False

    def feed(self, text: str) -> list[Event]:
        if self.calls and not self.parallel:
            return []
        # a long block is searched once, not again at every token
        searched = max(0, len(self._held) - len(CLOSE) + 1) if self._in_block else 0
        self._held += text
        out: list[Event] = []
        while True:
            if self._in_block:
                at = self._held.find(CLOSE, searched)
                searched = 0
                if at < 0:
                    return out
                out += self._block(self._held[:at], closed=True)
                self._held = "" if self.calls and not self.parallel else self._held[at + len(CLOSE):]
                self._in_block = False
                continue
            at = self._held.find(OPEN)
            if at >= 0:
                before = self._held[:at].rstrip()
                out += self._content(before)
                self._gap = self._held[len(before):at]
                self._held = self._held[at + len(OPEN):]
                self._in_block = True
                continue
            keep = _partial_tag(self._held)
            text, rest = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
            shown = text.rstrip()
            out += self._content(shown)
            self._held = text[len(shown):] + rest
            return out

    def end(self) -> list[Event]:
        held, self._held = self._held, ""
        if self._in_block:
            return self._block(held, closed=False)
        return self._content(held.rstrip() if self.calls else held)

    def _content(self, text: str) -> list[Event]:
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        return [text] if text else []

    def _block(self, body: str, closed: bool) -> list[Event]:
        call = _call(body, self.names)
        if call is None:
            return self._content(self._gap + OPEN + body + (CLOSE if closed else ""))
        name, arguments = call
        self.calls += 1
        self._after_call = True
        return [CallStart(self.calls - 1, call_id(), name), Arguments(self.calls - 1, arguments)]


def _partial_tag(text: str) -> int:
    """How many characters at the end of ``text`` could begin an opening tag."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


def _call(body: str, names: frozenset[str]) -> tuple[str, str] | None:
    """A block's function and arguments (as JSON text), or None where it is no call of an
    offered function. Arguments may be an object or the JSON text of one, or absent."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments: Any = value.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    return value["name"], json.dumps(arguments, ensure_ascii=False)


Reader = _Named | _Required | _Auto


def reader(use: ToolUse) -> Reader:
    """A choice's reader, for its text in order, then ``end()`` once the text is whole."""
    if use.mode == "named":
        return _Named(use.name or "")
    if use.mode == "required":
        return _Required()
    return _Auto(use.names, use.parallel)


def stops(use: ToolUse, stop: list[str]) -> list[str]:
    """The stop strings a request's answer is generated with: its own, and under ``"auto"``
    without parallel calls the closing tag, so that the worker ends the generation once the
    first block is whole and no token is spent on what would be dropped. The closing tag is cut
    from the text as any stop string is, and the block it leaves open is read as one cut short:
    a call where what it holds parses.

    A stop string rather than the gateway cancelling the request once it has read a call: an
    answer sent whole reaches the gateway only at its end, and a cancelled request's last record
    (its usage, what admission learns from it) never comes. A stop is the worker's own ending:
    each of ``n`` choices ends by itself, its usage counts the tokens sampled, and the client's
    stop strings work beside it (whichever comes first ends the answer). The reader still drops
    what follows a first call, for the answer a stop string does not end: one that has not yet
    reached its ``min_tokens`` (:func:`finish_reason` says it ended with its call all the same)."""
    if not use.ends_at_first_call or CLOSE in stop:
        return stop
    return [*stop, CLOSE]


def message(use: ToolUse, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole answer's content (None when it is only calls) and its calls, as OpenAI's
    ``message`` holds them."""
    read = reader(use)
    content: list[str] = []
    calls: list[dict[str, Any]] = []
    for event in read.feed(text) + read.end():
        if isinstance(event, str):
            content.append(event)
        elif isinstance(event, CallStart):
            calls.append({"id": event.id, "type": "function", "function": {"name": event.name, "arguments": ""}})
        else:
            calls[event.index]["function"]["arguments"] += event.text
    joined = "".join(content)
    return (joined or None) if calls else joined, calls


def finish_reason(finish: str, calls: int, use: ToolUse) -> str:
    """``tool_calls`` for an answer that ended by itself with calls, as at OpenAI, and for one
    whose first call is its last word (``ToolUse.ends_at_first_call``) whatever ended the
    generation after that call: ``min_tokens`` keeps the worker from stopping at the closing
    tag, and ``max_tokens`` may then cut what is dropped anyway. A call is read only once its
    JSON is whole, so the answer holds all of it."""
    return "tool_calls" if calls and (finish == "stop" or use.ends_at_first_call) else finish


class StreamedCalls:
    """One streamed choice's chunks, its text read as tool calls: content as content, a call's
    start with its id, name and empty arguments, then its arguments' text, as OpenAI sends them.
    Log-probabilities of text held back ride on the next chunk sent, or the last."""

    def __init__(self, use: ToolUse, writer: ChunkWriter) -> None:
        self._use = use
        self._read = reader(use)
        self._writer = writer
        self._logprobs: list[TokenLogprob] | None = None

    def text(self, text: str, use: dict[str, int] | None, logprobs: list[TokenLogprob] | None) -> list[bytes]:
        if logprobs is not None:
            self._logprobs = (self._logprobs or []) + logprobs
        return self._frames(self._read.feed(text), use)

    def finish(self, finish: str) -> list[bytes]:
        frames = self._frames(self._read.end(), None)
        reason = finish_reason(finish, self._read.calls, self._use)
        return frames + [self._writer.finish(reason, self._logprobs or None)]

    def _frames(self, events: list[Event], use: dict[str, int] | None) -> list[bytes]:
        frames = []
        for event in events:
            if isinstance(event, str):
                delta: dict[str, Any] = {"content": event}
            elif isinstance(event, CallStart):
                delta = {"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                         "function": {"name": event.name, "arguments": ""}}]}
            else:
                delta = {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}
            frames.append(self._writer.delta(delta, use, self._logprobs))
            if self._logprobs is not None:
                self._logprobs = []
        return frames
