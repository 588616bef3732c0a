"""Pick the next token for every row of a batch, each row under its own sampling params.

A batch mixes greedy and sampled requests. The all-greedy batch (the common interactive case)
costs one argmax. Each seeded request owns a ``torch.Generator`` and draws from it alone, and
filters its candidates on its own, so its tokens do not depend on what else shares the batch.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from slogate.protocol import GREEDY_BELOW, SamplingParams

LOGPROB_FLOOR = -9999.0


_MASK64 = 2**64 - 1


def make_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    """A generator for a seeded request; unseeded requests draw from torch's global one."""
    if params.seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(spread_seed(params.seed))
    return generator


def spread_seed(seed: int) -> int:
    """A request's seed (any 64-bit integer) as torch is given it. Torch's CPU generator keeps
    only the low 32 bits of a seed, so seeds that differ only above them (0 and 2**32) would
    sample alike; one splitmix64 step first makes every bit count."""
    z = (seed + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < GREEDY_BELOW


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


Grammar = tuple[list[int], torch.Tensor]
"""Rows held to a grammar (ascending), and the tokens each may not take next: a bool per
vocabulary entry, a row each in the same order."""


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    histories: Sequence[Sequence[int]],
    eos_token_ids: Collection[int] = (),
    grammar: Grammar | None = None,
) -> list[int]:
    """Next token per row of ``logits`` [B, V]; ``histories`` are each row's output tokens so
    far (what penalties and ``min_tokens`` count)."""
    held = grammar[0] if grammar is not None else []
    adjusted = [
        i
        for i, p in enumerate(params)
        if p.presence_penalty or p.frequency_penalty or p.logit_bias or len(histories[i]) < p.min_tokens
    ]
    if not adjusted and not held and all(is_greedy(p) for p in params):
        return logits.argmax(dim=-1).tolist()
    logits = logits.to(torch.float32, copy=bool(adjusted or held))
    for i in adjusted:
        _adjust_row(logits[i], params[i], histories[i])
    if grammar is not None:
        _mask_rows(logits, *grammar)
    for i in adjusted:
        _ban(logits[i], banned_tokens(params[i], len(histories[i]), eos_token_ids), i in held)
    greedy = [i for i, p in enumerate(params) if is_greedy(p)]
    sampled = [i for i, p in enumerate(params) if not is_greedy(p)]
    tokens = [0] * len(params)
    if greedy:
        for i, token in zip(greedy, logits[greedy].argmax(dim=-1).tolist()):
            tokens[i] = token
    if sampled:
        drawn = _sample_rows(logits[sampled], [params[i] for i in sampled], [generators[i] for i in sampled])
        for i, token in zip(sampled, drawn):
            tokens[i] = token
    return tokens


def _adjust_row(row: torch.Tensor, params: SamplingParams, history: Sequence[int]) -> None:
    """Penalties as OpenAI defines them (over the output so far), then the logit bias."""
    if history and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(
            torch.tensor(history, device=row.device), minlength=row.shape[0]
        )[: row.shape[0]].to(row.dtype)
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(row.dtype)
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), device=row.device)
        row[ids] += torch.tensor(list(params.logit_bias.values()), device=row.device, dtype=row.dtype)


def _mask_rows(logits: torch.Tensor, rows: list[int], blocked: torch.Tensor) -> None:
    """Every token a row's grammar rules out is out, in one operation for all rows."""
    blocked = blocked.to(logits.device)
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(blocked, float("-inf"))
        return
    index = torch.tensor(rows, device=logits.device)
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(blocked, float("-inf")))


def _ban(row: torch.Tensor, banned: list[int], give_way: bool) -> None:
    """The ``min_tokens`` ban. Under a grammar (``give_way``), a ban that would leave no token
    gives way: the output must stay valid, and ``min_tokens`` is only a floor on an output
    free to go on."""
    if not banned:
        return
    ids = torch.tensor(banned, device=row.device)
    kept = row[ids].clone()
    row[ids] = float("-inf")
    if give_way and not torch.isfinite(row).any():
        row[ids] = kept


def _sample_rows(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> list[int]:
    """Softmax with temperature; rows with top-k or top-p draw from their filtered candidates."""
    temperature = torch.tensor([p.temperature for p in params], device=logits.device).unsqueeze(1)
    probs = torch.softmax(logits / temperature, dim=-1)
    vocab = probs.shape[1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    filtered = [i for i, p in enumerate(params) if top_k[i] < vocab or p.top_p < 1.0]
    plain = [i for i in range(len(params)) if top_k[i] == vocab and params[i].top_p >= 1.0]
    tokens = [0] * len(params)
    if plain:
        for i, token in zip(plain, _draw(probs[plain], [generators[i] for i in plain]).tolist()):
            tokens[i] = token
    if filtered:
        kept, ids = _nucleus(probs[filtered], [top_k[i] for i in filtered], [params[i].top_p for i in filtered])
        columns = _draw(kept, [generators[i] for i in filtered])
        for i, token in zip(filtered, ids.gather(1, columns.unsqueeze(1)).squeeze(1).tolist()):
            tokens[i] = token
    return tokens


_CANDIDATE_WIDTHS = (64, 1024)
"""How many of the likeliest tokens top-k and top-p look at before sorting the whole
vocabulary. On CPU, sorting 16 rows of a 32k vocabulary takes about 40 ms a step; their 64
likeliest tokens, about 1 ms, and those usually hold the whole nucleus."""


def _nucleus(probs: torch.Tensor, top_k: list[int], top_p: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """The probabilities top-k then top-p keep (zero where they drop a token; top-p applies to
    the top-k distribution renormalized), over the likeliest tokens, and their ids.

    Each row's candidates widen until its filter ends inside them: its top-k fits, or, with no
    top-k, the candidates hold at least its top-p of the mass. So the result is exactly what
    filtering the fully sorted vocabulary gives. The width is the row's own, never its batch's:
    tied probabilities (common in bf16) come out of ``topk`` in an order that depends on the
    width, and a seeded request must draw the same token whatever shares its batch. Rows of a
    narrower width are padded with tokens of no mass."""
    vocab, device = probs.shape[1], probs.device
    rows = list(range(probs.shape[0]))
    groups: list[tuple[list[int], torch.Tensor, torch.Tensor]] = []
    for width in (*(w for w in _CANDIDATE_WIDTHS if w < vocab), vocab):
        values, ids = probs[rows].topk(width, dim=-1)
        masses = values.sum(dim=-1).tolist()
        fits = [width == vocab or top_k[row] <= width or (top_k[row] == vocab and mass >= top_p[row])
                for row, mass in zip(rows, masses)]
        done = [row for row, fit in zip(rows, fits) if fit]
        if done:
            at = [i for i, fit in enumerate(fits) if fit]
            kept = _filter(values[at], [top_k[r] for r in done], [top_p[r] for r in done], vocab)
            groups.append((done, kept, ids[at]))
        rows = [row for row, fit in zip(rows, fits) if not fit]
        if not rows:
            break
    if len(groups) == 1:  # every row at one width, in order
        return groups[0][1], groups[0][2]
    widest = max(kept.shape[1] for _, kept, _ in groups)
    values = torch.zeros(probs.shape[0], widest, dtype=probs.dtype, device=device)
    ids = torch.zeros(probs.shape[0], widest, dtype=torch.long, device=device)
    for done, kept, group_ids in groups:
        at = torch.tensor(done, device=device)
        values[at, :kept.shape[1]] = kept
        ids[at, :kept.shape[1]] = group_ids
    return values, ids


def _filter(values: torch.Tensor, top_k: list[int], top_p: list[float], vocab: int) -> torch.Tensor:
    """Top-k then top-p over candidates sorted likeliest first."""
    device = values.device
    ranks = torch.arange(values.shape[1], device=device).unsqueeze(0)
    k = torch.tensor(top_k, device=device).unsqueeze(1)
    values = values.masked_fill(ranks >= k, 0.0)
    # a row without top-k keeps the whole vocabulary's mass (1), not just the candidates'
    values = values / torch.where(k < vocab, values.sum(dim=-1, keepdim=True), 1.0)
    before = values.cumsum(dim=-1) - values
    drop = before >= torch.tensor(top_p, device=device).unsqueeze(1)
    drop[:, 0] = False
    return values.masked_fill(drop, 0.0)


def _draw(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One column per row by inverse CDF, from a single uniform number per row (the row's own
    generator's when seeded). ``torch.multinomial`` draws a random number per vocabulary entry
    instead: on CPU that was a quarter of a 16-stream step on the tiny model, and tens of
    milliseconds a step with a 32k vocabulary."""
    uniform = torch.rand(len(generators), device=probs.device)
    for row, generator in enumerate(generators):
        if generator is not None:
            uniform[row] = torch.rand((), generator=generator, device=probs.device)
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    # strictly below the total, so the first entry above the target always has mass
    target = torch.minimum(uniform.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def token_logprobs(logits: torch.Tensor, rows: Sequence[int], tokens: Sequence[int],
                   top: Sequence[int]) -> list[tuple[float, list[tuple[int, float]]]]:
    """For each of ``rows`` of ``logits`` [B, V]: the log-probability of its sampled token, and
    its ``top`` likeliest tokens with theirs, likeliest first. From the model's own
    distribution (the raw logits), not the one temperature or penalties drew from: what a
    client scores by is what the model thinks, whatever the request sampled with."""
    # JSON has no -inf (a masked logit): the floor vLLM answers with instead
    logprobs = torch.log_softmax(logits[list(rows)].to(torch.float32), dim=-1).clamp(min=LOGPROB_FLOOR)
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logits.device).unsqueeze(1)).squeeze(1).tolist()
    width = max(top, default=0)
    if width == 0:
        return [(lp, []) for lp in chosen]
    values, ids = logprobs.topk(min(width, logprobs.shape[1]), dim=-1)
    values, ids = values.tolist(), ids.tolist()
    return [(lp, list(zip(ids[i][:k], values[i][:k]))) for i, (lp, k) in enumerate(zip(chosen, top))]
