"""Pick the next token for every row of a batch, each row under its own sampling params.

A batch mixes greedy and sampled requests. The all-greedy batch (the common interactive case)
costs one argmax. Each seeded request owns a ``torch.Generator`` and draws from it alone, so
its tokens do not depend on what else shares the batch.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from slogate.protocol import SamplingParams

_GREEDY_BELOW = 1e-5


def make_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    """A generator for a seeded request; unseeded requests draw from torch's global one."""
    if params.seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed)
    return generator


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < _GREEDY_BELOW


def banned_tokens(
    params: SamplingParams, n_generated: int, eos_token_ids: Collection[int]
) -> list[int]:
    """Tokens that would end the output before ``min_tokens`` is reached."""
    if n_generated >= params.min_tokens:
        return []
    banned = list(params.stop_token_ids)
    if not params.ignore_eos:
        banned.extend(eos_token_ids)
    return banned


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    histories: Sequence[Sequence[int]],
    eos_token_ids: Collection[int] = (),
) -> list[int]:
    """Next token per row of ``logits`` [B, V]; ``histories`` are each row's output tokens so
    far (what penalties and ``min_tokens`` count)."""
    adjusted = [
        i
        for i, p in enumerate(params)
        if p.presence_penalty or p.frequency_penalty or len(histories[i]) < p.min_tokens
    ]
    if not adjusted and all(is_greedy(p) for p in params):
        return logits.argmax(dim=-1).tolist()
    logits = logits.to(torch.float32, copy=bool(adjusted))
    for i in adjusted:
        _adjust_row(logits[i], params[i], histories[i], eos_token_ids)
    tokens = logits.argmax(dim=-1).tolist()
    sampled = [i for i, p in enumerate(params) if not is_greedy(p)]
    if sampled:
        probs = _filtered_probs(logits[sampled], [params[i] for i in sampled])
        for row, i in enumerate(sampled):
            tokens[i] = int(torch.multinomial(probs[row], 1, generator=generators[i]).item())
    return tokens


def _adjust_row(
    row: torch.Tensor, params: SamplingParams, history: Sequence[int], eos_token_ids: Collection[int]
) -> None:
    """Penalties as OpenAI defines them (over the output so far), then the min_tokens ban."""
    if history and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(
            torch.tensor(history, device=row.device), minlength=row.shape[0]
        )[: row.shape[0]].to(row.dtype)
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(row.dtype)
    banned = banned_tokens(params, len(history), eos_token_ids)
    if banned:
        row[torch.tensor(banned, device=row.device)] = float("-inf")


def _filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Softmax with temperature, then top-k and top-p masks, done on one sorted copy."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
    logits = logits / temperature
    vocab = logits.shape[1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    if min(top_k) == vocab and min(top_p) >= 1.0:
        return torch.softmax(logits, dim=-1)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device).unsqueeze(0)
    drop = ranks >= torch.tensor(top_k, device=device).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = before >= torch.tensor(top_p, device=device).unsqueeze(1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    filtered = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    return torch.softmax(filtered, dim=-1)
