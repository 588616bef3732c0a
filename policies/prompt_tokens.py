"""How many tokens a prompt is, from its characters, learned per model from what workers count.

The gateway has no tokenizer (it must stay light), yet admission prices every prompt by its
tokens and rate limits count them. Characters a token differ by tokenizer and by language far
more than any fixed figure allows: about 4 for English under a large BPE vocabulary, under 3 for
a small one, near 1 for Chinese. A fixed 4 priced the tiny model's 393-token risk prompts at 263
tokens, so a burst of them was admitted half again as large as its prefill allowed. Every
finished request comes back with the worker's exact count, so the ratio is learned per model
instead, starting from 4.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

PRIOR_CHARS_PER_TOKEN = 4.0
TOKENS_PER_MESSAGE = 4
"""What a chat template adds around each message (role markers, separators)."""
MIN_CHARS = 64
"""Shorter prompts are mostly template: they teach the ratio nothing."""
ALPHA = 0.1
TOKENS_PER_CHAR_BOUNDS = (1 / 16, 4.0)


@dataclass
class PromptTokens:
    _tokens_per_char: dict[str, float] = field(default_factory=dict)

    def chars_per_token(self, model: str) -> float:
        return 1.0 / self._tokens_per_char.get(model, 1.0 / PRIOR_CHARS_PER_TOKEN)

    def learned(self) -> dict[str, float]:
        """Characters a token, for each model a worker has counted a prompt of."""
        return {model: 1.0 / ratio for model, ratio in self._tokens_per_char.items()}

    def estimate(self, model: str, chars: int, messages: int) -> int:
        """``messages``: how many chat messages (0 for a plain prompt)."""
        ratio = self._tokens_per_char.get(model, 1.0 / PRIOR_CHARS_PER_TOKEN)
        return max(1, math.ceil(chars * ratio) + TOKENS_PER_MESSAGE * messages)

    def observe(self, model: str, chars: int, messages: int, tokens: int) -> None:
        """A worker counted ``tokens`` for a prompt of ``chars`` characters in ``messages``."""
        if chars < MIN_CHARS or tokens <= 0:
            return
        low, high = TOKENS_PER_CHAR_BOUNDS
        seen = min(max((tokens - TOKENS_PER_MESSAGE * messages) / chars, low), high)
        old = self._tokens_per_char.get(model)
        self._tokens_per_char[model] = seen if old is None else (1 - ALPHA) * old + ALPHA * seen
