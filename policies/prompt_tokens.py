"""How many tokens a prompt is, from its characters, learned from what workers count.

The gateway has no tokenizer (it must stay light), yet admission prices every prompt by its
tokens. Characters a token differ by tokenizer and by language far more than any fixed figure
allows: about 4 for English under a large BPE vocabulary, under 3 for a small one, near 1 for
Chinese. A fixed 4 priced the tiny model's 393-token risk prompts at 263 tokens, so a burst of
them was admitted half again as large as its prefill allowed. Every finished request comes back
with the worker's exact count, so the ratio is learned instead, starting from 4.

It is learned per model and per API key, and a key's own ratio is used once it has sent a few
thousand characters (before that, the prior). What one key sends (Chinese, emoji, code) then
prices only its own prompts: with one ratio for all, a key sending a tenth of the traffic as
long prompts of emoji (three tokens a character) priced everyone else's English at four times
its length, and their requests were shed for it. A new key is not given the ratio over all
keys either: priced by another key's emoji, its first prompts would be shed, and a key whose
every prompt is shed never learns its own ratio. The ratio over all keys is kept for the
metric alone.

A ratio is the recent prompts' tokens over their characters, both summed, so each prompt weighs
as much as it is long: a short prompt is mostly its chat template and says little of the text.
Prompts with no tokens beyond the template are skipped. The sums decay, so a ratio follows the
last hundred prompts or so.

Rate limits do not use the learned ratio: what a key is charged must follow from what it sent.

Gateways leave what they learned in Redis (``saved``) and a gateway that starts takes it up
(``restore``): without it each restart, and each new replica, priced every key at the prior
again until the key had sent a few thousand characters to it, under-pricing Chinese four times.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import msgspec

PRIOR_CHARS_PER_TOKEN = 4.0
TOKENS_PER_MESSAGE = 4
"""What a chat template adds around each message (role markers, separators), at least."""
MIN_CHARS = 64
"""Shorter prompts are mostly template: they teach the ratio nothing."""
OWN_CHARS = 4096.0
"""Characters (decayed) of a key's own prompts before its own ratio is used."""
DECAY = 0.99
"""Weight left to what was learned before each new prompt."""
TOKENS_PER_CHAR_BOUNDS = (1 / 16, 4.0)


def prior_estimate(chars: int, messages: int) -> int:
    """Tokens at the fixed prior: what rate limits charge."""
    return max(1, math.ceil(chars / PRIOR_CHARS_PER_TOKEN) + TOKENS_PER_MESSAGE * messages)


@dataclass
class PromptTokens:
    _sums: dict[tuple[str, str | None], list[float]] = field(default_factory=dict)
    """(model, key or None for all keys) -> [decayed tokens beyond the template, decayed characters]."""
    _changed: set[tuple[str, str | None]] = field(default_factory=set)
    """Ratios learned since the last ``take_changes``."""

    def _tokens_per_char(self, model: str, key: str | None) -> float:
        sums = self._sums.get((model, key))
        if sums is None or sums[1] < OWN_CHARS:
            return 1.0 / PRIOR_CHARS_PER_TOKEN
        low, high = TOKENS_PER_CHAR_BOUNDS
        return min(max(sums[0] / sums[1], low), high)

    def chars_per_token(self, model: str, key: str | None = None) -> float:
        """For ``key``'s prompts, or over all keys' (``None``: the metric)."""
        return 1.0 / self._tokens_per_char(model, key)

    def learned(self) -> dict[str, float]:
        """Characters a token over all keys, for each model a worker has counted a prompt of."""
        return {model: self.chars_per_token(model) for model, key in self._sums if key is None}

    def estimate(self, model: str, key: str, chars: int, messages: int) -> int:
        """``messages``: how many chat messages (0 for a plain prompt)."""
        return max(1, math.ceil(chars * self._tokens_per_char(model, key)) + TOKENS_PER_MESSAGE * messages)

    def observe(self, model: str, key: str, chars: int, messages: int, tokens: int) -> None:
        """A worker counted ``tokens`` for ``key``'s prompt of ``chars`` characters in ``messages``."""
        text_tokens = tokens - TOKENS_PER_MESSAGE * messages
        if chars < MIN_CHARS or text_tokens <= 0:
            return
        for who in (key, None):
            sums = self._sums.setdefault((model, who), [0.0, 0.0])
            sums[0] = DECAY * sums[0] + text_tokens
            sums[1] = DECAY * sums[1] + chars
            self._changed.add((model, who))

    def take_changes(self, now: float) -> dict[bytes, bytes]:
        """The ratios learned since the last call, as ``restore`` takes them: JSON ``[model,
        key]`` -> ``[tokens, chars, now]``. Only those: a ratio this gateway took up and never
        learned more of must not overwrite what another gateway learned since."""
        changed, self._changed = self._changed, set()
        return {_json.encode([model, key]): _json.encode([*self._sums[(model, key)], now]) for model, key in changed}

    def restore(self, saved: Mapping[bytes, bytes], now: float, max_age_s: float) -> tuple[int, list[bytes]]:
        """Take up sums other gateways saved within ``max_age_s``, for every ratio this one has
        learned nothing of. Returns how many it took, and the names of entries too old or
        unreadable (for the caller to delete)."""
        taken, stale = 0, []
        for name, value in saved.items():
            try:
                model, key = msgspec.json.decode(name, type=tuple[str, str | None])
                tokens, chars, at = msgspec.json.decode(value, type=tuple[float, float, float])
            except msgspec.DecodeError:
                stale.append(name)
                continue
            if not (0 < tokens and 0 < chars and math.isfinite(tokens + chars)) or now - at > max_age_s:
                stale.append(name)
            elif (model, key) not in self._sums:
                self._sums[(model, key)] = [tokens, chars]
                taken += 1
        return taken, stale


_json = msgspec.json.Encoder()
