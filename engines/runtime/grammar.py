"""Holding a request's output to its JSON schema, token by token.

Each such request has a matcher (llguidance) that knows which tokens may come next; sampling
masks the rest out of its row, and the sampled token advances the matcher. The request ends
the moment the matcher allows nothing more (the JSON is complete), without waiting for the
model to choose EOS: a small model may never choose it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection
from concurrent.futures import Future
from typing import Any
from weakref import WeakKeyDictionary

import llguidance
import llguidance.hf
import numpy as np
import torch

from slogate import json_output


class Grammars:
    """An engine's JSON schemas: its tokenizer as llguidance reads it (built with the engine; a
    large vocabulary takes about a second), the schemas compiled on a thread of their own, and
    the last 16 kept (a compile may hold tens of megabytes), so an app that sends the same
    schema with every request pays for one compile."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Collection[int], keep: int = 16) -> None:
        self._vocab_size = vocab_size
        self._tokenizer: Any = None
        self._tokenizer_error: TokenizerUnsupported | None = None
        # Built here, on the engine's thread: on the compile thread, borrowing the tokenizer
        # beside a prompt being tokenized can fail ("Already borrowed"). llguidance wants every
        # token the tokenizer has; those beyond the model's logits are cut from the masks again.
        try:
            self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=max(vocab_size, len(tokenizer)),
                                                           eos_token=sorted(eos_token_ids) or None)
        except Exception as exc:  # noqa: BLE001 - JSON output refused with the reason, the engine serves on
            self._tokenizer_error = TokenizerUnsupported(
                f"this model's tokenizer cannot constrain output to JSON: {exc}")
        self._compiler = json_output.compiler("json-schema")
        """Compiles beside the steps (llguidance lets go of the GIL): a large schema takes
        tenths of a second, which between two steps would stall every stream."""
        self._compiled: OrderedDict[bytes, Future[Any]] = OrderedDict()
        """By digest of the schema: its compile, done or not (a failed one keeps its error)."""
        self._starts: WeakKeyDictionary[Future[Any], int] = WeakKeyDictionary()
        """How many matchers each compile gave (:meth:`shared`)."""
        self._keep = keep

    def compile(self, schema: str) -> Future[Any]:
        """The compile of ``schema``: started now on the compile thread unless kept or under
        way. Its result is a pristine matcher, for :meth:`start`; its error a ValueError with a
        reason a client can act on."""
        key = json_output.digest(schema)
        compiled = self._compiled.get(key)
        if compiled is None or compiled.cancelled() or _failed_by_chance(compiled):
            compiled = self._compiled[key] = self._compiler.submit(self._build, schema)
            while len(self._compiled) > self._keep:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(key)
        return compiled

    def forget(self, schema: str) -> None:
        """Drop a kept compile whose matchers failed: copies share its lexer and the lexer's
        budget, so once one request used that up, every later copy would fail too."""
        self._compiled.pop(json_output.digest(schema), None)

    def start(self, compiled: Future[Any]) -> Any:
        """A matcher of one request's own from a finished compile (raises its ValueError)."""
        matcher = compiled.result().deep_copy()
        self._starts[compiled] = self._starts.get(compiled, 0) + 1
        return matcher

    def shared(self, compiled: Future[Any]) -> bool:
        """Whether ``compiled`` gave more than one matcher: they share its lexer and the limit
        on its states, so where one fails on that limit the others' work may have filled it."""
        return self._starts.get(compiled, 0) > 1

    def _build(self, schema: str) -> Any:
        """A matcher at the start of the output, its first mask computed here, on the compile
        thread: for a large schema that takes as long as the compile, and between two steps it
        would stall every stream."""
        if self._tokenizer_error is not None:
            raise self._tokenizer_error
        matcher = llguidance.LLMatcher(self._tokenizer, json_output.grammar(schema), log_level=0,
                                       limits=json_output.LIMITS)
        matcher.compute_bitmask()
        if matcher.is_error():
            raise ValueError(matcher_error(matcher))
        return matcher

    def blocked(self, matchers: list[Any]) -> torch.Tensor:
        """The tokens each matcher rules out next: a bool per vocabulary entry, a row each.
        Computed here, one matcher after another: llguidance's parallel executor hands the work
        to threads of its own, which on 2 cores cost more than they saved (16 streams of the
        tiny model: steps 65-85 µs a stream longer than free text with it, 30-42 without; two
        runs each of ``benchmarks.json_output``). A matcher that failed allows only EOS; one
        that allows nothing at all blocks nothing, so that a row always has a token of the
        vocabulary to sample (the request then ends with the matcher's error)."""
        masks = np.frombuffer(b"".join(m.compute_bitmask() for m in matchers), dtype=np.uint8)
        allowed = np.unpackbits(masks.reshape(len(matchers), -1), axis=1, bitorder="little")[:, : self._vocab_size]
        blocked = allowed == 0
        blocked &= allowed.any(axis=1, keepdims=True)
        return torch.from_numpy(blocked)

    def advance(self, matchers: list[Any], tokens: list[int]) -> None:
        """Each matcher takes its sampled token (one that fails leaves it in error)."""
        for matcher, token in zip(matchers, tokens):
            matcher.consume_token(token)

class TokenizerUnsupported(ValueError):
    """The model's tokenizer is not one llguidance reads (a slow, Python-only one)."""


def matcher_error(matcher: Any) -> str:
    """Why a matcher failed, in one line a client can read."""
    text = json_output.one_line(matcher.get_error())
    return "the schema allows no output at this point (NoExtensionBias)" if text == "NoExtensionBias" else text


def _failed_by_chance(compiled: Future[Any]) -> bool:
    """A compile that raised something other than a client's fault (a ValueError), which a
    later request should not inherit."""
    if not compiled.done() or compiled.cancelled():
        return False
    error = compiled.exception()
    return error is not None and not isinstance(error, ValueError)
