"""Holding a request's output to its JSON schema, token by token.

Each such request has a matcher (llguidance) that knows which tokens may come next; sampling
masks the rest out of its row, and the sampled token advances the matcher. The request ends
the moment the matcher allows nothing more (the JSON is complete), without waiting for the
model to choose EOS: a small model may never choose it.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import llguidance
import llguidance.hf
import numpy as np
import torch

from slogate import json_output


class Grammars:
    """An engine's view of its tokenizer as llguidance reads it, built at the first request
    that needs it (a model with a large vocabulary takes about a second) and kept."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Collection[int]) -> None:
        self._hf = tokenizer
        self._vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._tokenizer: Any = None
        self._executor = llguidance.LLExecutor()

    def matcher(self, schema: str) -> Any:
        """A matcher for ``schema`` at the start of the output. Raises ValueError with a reason
        a client can act on (the schema does not compile, or this model's tokenizer is not one
        llguidance reads)."""
        compiled = json_output.grammar(schema)
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), compiled, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def blocked(self, matchers: list[Any]) -> torch.Tensor:
        """The tokens each matcher rules out next: a bool per vocabulary entry, a row each. The
        masks are computed together on llguidance's threads, without the GIL. A matcher that
        failed allows only EOS; one that allows nothing at all blocks nothing, so that a row
        always has a token of the vocabulary to sample (the request then ends with the
        matcher's error)."""
        words = (self._vocab_size + 31) // 32
        masks = np.empty((len(matchers), words), dtype=np.int32)
        self._executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], masks.ctypes.data,
                                               words * 4, len(matchers))
        allowed = np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little")[:, : self._vocab_size]
        blocked = allowed == 0
        blocked &= allowed.any(axis=1, keepdims=True)
        return torch.from_numpy(blocked)

    def advance(self, matchers: list[Any], tokens: list[int]) -> None:
        """Each matcher takes its sampled token (one that fails leaves it in error)."""
        self._executor.consume_token_par(list(zip(matchers, tokens)))

    def _llg_tokenizer(self) -> Any:
        if self._tokenizer is None:
            try:
                self._tokenizer = llguidance.hf.from_tokenizer(self._hf, n_vocab=self._vocab_size,
                                                               eos_token=self._eos or None)
            except ValueError as exc:
                raise ValueError(f"this model's tokenizer cannot constrain output to JSON: {exc}") from exc
        return self._tokenizer
