"""Turn a request's result records into client text exactly once, across worker retries.

When a worker dies mid-request another one replays it from the start. Each delta says where
its text starts (``offset``) and which delivery made it (``attempt``), so the replayed prefix
is dropped. A replay can only be trusted to repeat the same text when decoding is
deterministic; if it is not and text was already streamed, the client gets an error rather
than a spliced answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from slogate.protocol import Delta, Error, Final, Result, TokenLogprob


class SplicedOutput(Exception):
    """A retry would contradict text the client already has (``worker_failed``), or text is
    missing before a delta or at the end (``result_lost``: on its way through Redis, no worker's doing)."""

    def __init__(self, message: str, code: str = "worker_failed") -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Relay:
    streamed: bool
    deterministic: bool
    attempt: int = 0
    text: str = ""
    """Everything accepted so far (for a streamed request: what the client was sent)."""
    tokens: int = 0
    """Log-probabilities accepted so far (a request that asked for them has one a token)."""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    """All of them, for a request not streamed (a stream's go out as they come)."""
    fresh: list[TokenLogprob] = field(default_factory=list)
    """Those the last record accepted added."""

    def accept(self, rec: Result) -> str | None:
        """The new text a record adds ("" when it adds only log-probabilities, ``fresh``), or
        None when the record is stale or repeats."""
        if rec.attempt and rec.attempt < self.attempt:
            return None
        if rec.attempt > self.attempt:
            self._new_attempt(rec)
        if isinstance(rec, Error):
            return None
        if rec.offset > len(self.text) or rec.token_offset > self.tokens:
            raise SplicedOutput(f"part of the answer was lost on its way from the worker (text from character "
                                f"{rec.offset} arrived after {len(self.text)}, log-probabilities from token "
                                f"{rec.token_offset} after {self.tokens})", "result_lost")
        if isinstance(rec, Final):
            return None
        new = rec.text[len(self.text) - rec.offset:]
        self.fresh = rec.logprobs[self.tokens - rec.token_offset:]
        if not new and not self.fresh:
            return None
        self.text += new
        self.tokens += len(self.fresh)
        if not self.streamed:
            self.logprobs += self.fresh
        return new

    def _new_attempt(self, rec: Delta | Final | Error) -> None:
        first = self.attempt == 0
        self.attempt = rec.attempt
        if first or self.deterministic or (not self.text and not self.tokens):
            return
        if self.streamed:
            raise SplicedOutput("the worker serving this request failed after streaming part of "
                                "the answer, and sampling is not deterministic, so it cannot resume")
        self.text, self.tokens, self.logprobs = "", 0, []
        if isinstance(rec, Delta) and (rec.offset or rec.token_offset):
            raise SplicedOutput("a retried request resumed mid-answer with non-deterministic sampling")
