"""Turn a request's tokens into text that is safe to stream, and decide when it ends.

Two things make streaming text harder than decoding at the end. A character may span several
tokens (byte-level BPE splits Chinese and emoji into bytes), so a delta must wait until its
characters are whole. And a stop string may arrive over several tokens, so text that could be
the start of one must wait until it is clear whether it completes: a client must never see
part of a stop string.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from slogate.protocol import FinishReason, SamplingParams

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 6
"""Prompt tokens decoded before the output, so the first output token decodes as it would
inside the text (tokenizers that drop a leading space at the start of a string need this)."""


class IncrementalDecoder:
    """Decodes a growing token list window by window.

    ``prefix`` marks where the last decoded window starts and ``read`` where its new part
    starts. Each step decodes the window from ``prefix`` twice, with and without the new
    tokens; the difference is the new text, held back while it ends in an incomplete
    character. Decoding a short window keeps each step cheap however long the output grows.
    """

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT:])
        self._prefix = 0
        self._read = len(self._ids)
        self.at_start = not self._decode(self._ids)
        """Whether no token so far has decoded to text: the next may lose its leading space."""

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """What was held back for being incomplete; at the end it can only be shown as is."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) <= len(before) or (after.endswith(_REPLACEMENT) and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        self.at_start = False
        return after[len(before) :]


class OutputTracker:
    """One request's output: its tokens, the text shown so far, and why it ended."""

    def __init__(
        self,
        tokenizer: Any,
        params: SamplingParams,
        eos_token_ids: Collection[int],
        prompt_ids: Sequence[int] = (),
    ) -> None:
        self.params = params
        self.token_ids: list[int] = []
        self.text = ""
        """Everything returned so far."""
        self.finish_reason: FinishReason | None = None
        self._decoder = IncrementalDecoder(tokenizer, prompt_ids)
        self._eos = frozenset(eos_token_ids)
        self._stop_ids = frozenset(params.stop_token_ids)
        self._stops = [s for s in params.stop if s]
        self._pending = ""
        """Decoded text held back because it may be the start of a stop string."""

    @property
    def at_start(self) -> bool:
        """Whether the next token starts the text (see :class:`~engines.runtime.token_pieces.TokenPieces`)."""
        return self._decoder.at_start

    def append(self, token_id: int) -> tuple[str, FinishReason | None]:
        """Add a sampled token; return the text now safe to show and a finish reason if the
        request is done. After a finish, nothing more may be appended."""
        if self.finish_reason is not None:
            raise RuntimeError("append after the output finished")
        self.token_ids.append(token_id)
        armed = len(self.token_ids) >= self.params.min_tokens
        ends = token_id in self._stop_ids or (token_id in self._eos and not self.params.ignore_eos)
        if armed and ends:
            return self._finish("stop", self.flush())
        self._pending += self._decoder.push(token_id)
        if armed:
            cut = _find_stop(self._pending, self._stops)
            if cut is not None:
                self._pending = self._pending[:cut]
                return self._finish("stop", self._take(len(self._pending)))
        if len(self.token_ids) >= self.params.max_tokens:
            return self._finish("length", self.flush())
        # Held before min_tokens too: a stop string begun before it may end after it.
        hold = _stop_prefix_len(self._pending, self._stops)
        return self._take(len(self._pending) - hold), None

    def end(self) -> str:
        """Finish with ``stop``: the output is complete (its JSON schema allows nothing more),
        even where the token that completed it was the last ``max_tokens`` allowed. Returns
        the text still held back."""
        text = self.flush() if self.finish_reason is None else ""
        self.finish_reason = "stop"
        return text

    def flush(self) -> str:
        """All text still held back, for when the output ends for a reason other than a stop
        string (no held-back prefix can complete any more)."""
        self._pending += self._decoder.flush()
        return self._take(len(self._pending))

    def _take(self, n: int) -> str:
        out, self._pending = self._pending[:n], self._pending[n:]
        self.text += out
        return out

    def _finish(self, reason: FinishReason, text: str) -> tuple[str, FinishReason]:
        self.finish_reason = reason
        return text, reason


def _find_stop(text: str, stops: Sequence[str]) -> int | None:
    """Where the earliest stop string starts in ``text``, if any does."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that a stop string starts with."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest
