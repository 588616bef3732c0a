"""How many tokens a prompt is, from its characters, learned per model from what workers count.

The gateway has no tokenizer (it must stay light), yet admission prices every prompt by its
tokens. Characters a token differ by tokenizer and by language far more than any fixed figure
allows: about 4 for English under a large BPE vocabulary, under 3 for a small one, near 1 for
Chinese. A fixed 4 priced the tiny model's 393-token risk prompts at 263 tokens, so a burst of
them was admitted half again as large as its prefill allowed. Every finished request comes back
with the worker's exact count, so the ratio is learned per model instead, starting from 4.

The ratio is the recent prompts' tokens over their characters, both summed, so each prompt
weighs as much as it is long. A short prompt is mostly its chat template, and its ratio says
little of the text: averaged as an equal, ten messages of a few words each moved the ratio
further than a long prompt could, and a client sending many tiny prompts of emoji (three tokens
a character) could make every other client's prompts look five times longer than they are.
Weighed by length, such prompts barely count. The sums decay, so the ratio follows the traffic
of the last hundred prompts or so.

Rate limits do not use the learned ratio: what one key is charged must not depend on what other
keys send.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

PRIOR_CHARS_PER_TOKEN = 4.0
TOKENS_PER_MESSAGE = 4
"""What a chat template adds around each message (role markers, separators), at least."""
MIN_CHARS = 64
"""Shorter prompts are mostly template: they teach the ratio nothing."""
DECAY = 0.99
"""Weight left to what was learned before each new prompt."""
TOKENS_PER_CHAR_BOUNDS = (1 / 16, 4.0)


def prior_estimate(chars: int, messages: int) -> int:
    """Tokens at the fixed prior: what rate limits charge."""
    return max(1, math.ceil(chars / PRIOR_CHARS_PER_TOKEN) + TOKENS_PER_MESSAGE * messages)


@dataclass
class PromptTokens:
    _sums: dict[str, list[float]] = field(default_factory=dict)
    """Model -> [decayed tokens beyond the template, decayed characters]."""

    def _tokens_per_char(self, model: str) -> float:
        sums = self._sums.get(model)
        if sums is None:
            return 1.0 / PRIOR_CHARS_PER_TOKEN
        low, high = TOKENS_PER_CHAR_BOUNDS
        return min(max(sums[0] / sums[1], low), high)

    def chars_per_token(self, model: str) -> float:
        return 1.0 / self._tokens_per_char(model)

    def learned(self) -> dict[str, float]:
        """Characters a token, for each model a worker has counted a prompt of."""
        return {model: self.chars_per_token(model) for model in self._sums}

    def estimate(self, model: str, chars: int, messages: int) -> int:
        """``messages``: how many chat messages (0 for a plain prompt)."""
        return max(1, math.ceil(chars * self._tokens_per_char(model)) + TOKENS_PER_MESSAGE * messages)

    def observe(self, model: str, chars: int, messages: int, tokens: int) -> None:
        """A worker counted ``tokens`` for a prompt of ``chars`` characters in ``messages``."""
        text_tokens = tokens - TOKENS_PER_MESSAGE * messages
        if chars < MIN_CHARS or text_tokens <= 0:
            return
        sums = self._sums.setdefault(model, [0.0, 0.0])
        sums[0] = DECAY * sums[0] + text_tokens
        sums[1] = DECAY * sums[1] + chars
