from __future__ import annotations

import math

import pytest
import torch

from engines.runtime.sampling import make_generator, sample, token_logprobs
from slogate.protocol import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

V = 50


def logits(batch: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(batch, V, generator=torch.Generator().manual_seed(seed)) * scale


def test_greedy_rows_take_the_argmax():
    x = logits(4)
    tokens = sample(x, [SamplingParams(temperature=0)] * 4, [None] * 4, [[]] * 4)
    assert tokens == x.argmax(dim=-1).tolist()


def test_same_seed_same_tokens_whatever_shares_the_batch():
    params = SamplingParams(temperature=1.0, seed=1234)

    def draw(batch_logits: torch.Tensor, row: int, others: list[SamplingParams]) -> list[int]:
        generator = make_generator(params, "cpu")
        plist = list(others)
        plist.insert(row, params)
        gens = [make_generator(p, "cpu") for p in plist]
        gens[row] = generator
        out = []
        for _ in range(20):
            out.append(sample(batch_logits, plist, gens, [[]] * len(plist))[row])
        return out

    x = logits(1, scale=1.0)
    alone = draw(x, 0, [])
    crowded_logits = torch.cat([logits(1, seed=5), x, logits(1, seed=6)])
    crowded = draw(crowded_logits, 1, [SamplingParams(temperature=0.7), SamplingParams(temperature=0)])
    assert alone == crowded
    assert len(set(alone)) > 1, "sampling at temperature 1 must vary"
    other_seed = make_generator(SamplingParams(seed=99), "cpu")
    different = [sample(x, [SamplingParams(seed=99)], [other_seed], [[]])[0] for _ in range(20)]
    assert different != alone


def test_seeded_top_p_draws_do_not_depend_on_the_batch_when_logits_tie() -> None:
    """bf16 logits (the GPU default) tie often; a seeded row's tokens must still not depend
    on which other rows share the step."""
    vocab = 3000
    row = torch.full((1, vocab), -5.0)
    row[0, :100] = 5.0  # 100 tokens tied at the top, as bf16 logits often are
    flat = torch.linspace(1.0, 0.0, vocab).unsqueeze(0)  # its 0.99 nucleus needs the whole vocabulary
    mine = SamplingParams(temperature=1.0, top_p=0.5, seed=7)
    other = SamplingParams(temperature=1.0, top_p=0.99, seed=8)
    alone_gen, crowded_gen, other_gen = (make_generator(p, "cpu") for p in (mine, mine, other))
    alone = [sample(row, [mine], [alone_gen], [[]])[0] for _ in range(20)]
    crowded = [sample(torch.cat([row, flat]), [mine, other], [crowded_gen, other_gen], [[], []])[0]
               for _ in range(20)]
    assert alone == crowded


def test_top_k_one_and_tiny_top_p_are_greedy():
    x = logits(3)
    greedy = x.argmax(dim=-1).tolist()
    for params in (SamplingParams(top_k=1, seed=1), SamplingParams(top_p=1e-6, seed=1)):
        gens = [make_generator(params, "cpu") for _ in range(3)]
        for _ in range(10):
            assert sample(x, [params] * 3, gens, [[]] * 3) == greedy


def test_top_k_draws_only_from_the_k_best():
    x = logits(1)
    allowed = set(x[0].topk(3).indices.tolist())
    params = SamplingParams(temperature=5.0, top_k=3, seed=7)
    gen = make_generator(params, "cpu")
    drawn = {sample(x, [params], [gen], [[]])[0] for _ in range(200)}
    assert drawn <= allowed
    assert len(drawn) > 1


def test_top_p_keeps_the_smallest_set_reaching_p():
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    params = SamplingParams(temperature=1.0, top_p=0.7, seed=3)
    gen = make_generator(params, "cpu")
    drawn = {sample(x, [params], [gen], [[]])[0] for _ in range(300)}
    assert drawn == {0, 1}


def test_min_tokens_bans_eos_and_stop_tokens_until_reached():
    x = torch.zeros(1, V)
    x[0, 1] = 10.0
    x[0, 2] = 9.0
    x[0, 3] = 8.0
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2])
    assert sample(x, [params], [None], [[5]], eos_token_ids={1}) == [3]
    assert sample(x, [params], [None], [[5, 5]], eos_token_ids={1}) == [1]
    assert x[0, 1] == 10.0, "the caller's logits are left alone"
    no_eos = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)
    assert sample(x, [no_eos], [None], [[]], eos_token_ids={1}) == [1]


def test_penalties_push_away_from_repeated_tokens():
    x = torch.zeros(1, V)
    x[0, 4] = 1.0
    x[0, 9] = 0.5
    history = [4, 4, 4]
    assert sample(x, [SamplingParams(temperature=0)], [None], [history]) == [4]
    freq = SamplingParams(temperature=0, frequency_penalty=0.2)
    assert sample(x, [freq], [None], [history]) == [9]
    presence = SamplingParams(temperature=0, presence_penalty=0.4)
    assert sample(x, [presence], [None], [history]) == [4]
    presence = SamplingParams(temperature=0, presence_penalty=0.6)
    assert sample(x, [presence], [None], [history]) == [9]


def test_draws_follow_each_rows_distribution():
    wanted = [torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0]), torch.tensor([0.0, 0.1, 0.0, 0.2, 0.7])]
    x = torch.log(torch.stack(wanted))
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, seed=11)]
    gens = [make_generator(p, "cpu") for p in params]
    draws = 4000
    counts = torch.zeros(2, 5)
    for _ in range(draws):
        for row, token in enumerate(sample(x, params, gens, [[], []])):
            counts[row, token] += 1
    for row in range(2):
        assert counts[row][wanted[row] == 0].sum() == 0, "a token without mass was drawn"
        assert torch.allclose(counts[row] / draws, wanted[row], atol=0.03), (row, counts[row] / draws)


def _reference_nucleus(row: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    """Top-k then top-p over the fully sorted vocabulary."""
    probs, order = torch.softmax(row, dim=-1).sort(descending=True)
    probs = probs[:top_k] / probs[:top_k].sum()
    before = probs.cumsum(dim=0) - probs
    keep = int((before < top_p).sum())
    return set(order[: max(1, keep)].tolist())


def test_top_p_beyond_the_first_candidates_matches_a_full_sort():
    vocab = 3000
    # a flat, strictly ordered distribution: the 0.9 nucleus holds most of the vocabulary
    flat = torch.linspace(1.0, 0.0, vocab).unsqueeze(0)
    peaked = torch.randn(1, vocab, generator=torch.Generator().manual_seed(3)) * 4
    rows = torch.cat([flat, peaked])
    cases = [SamplingParams(temperature=1.0, top_p=0.9, seed=1), SamplingParams(temperature=1.0, top_p=0.5, seed=2)]
    gens = [make_generator(p, "cpu") for p in cases]
    drawn: list[set[int]] = [set(), set()]
    for _ in range(1500):
        for row, token in enumerate(sample(rows, cases, gens, [[], []])):
            drawn[row].add(token)
    for row, params in enumerate(cases):
        nucleus = _reference_nucleus(rows[row], vocab, params.top_p)
        assert drawn[row] <= nucleus
    assert max(drawn[0]) > 1024, "the flat row's nucleus reaches past the widest candidate set"
    assert len(drawn[1]) > 1


def test_top_k_with_top_p_renormalizes_before_the_nucleus():
    x = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1] + [0.0] * 100]) + 1e-12)
    params = SamplingParams(temperature=1.0, top_k=2, top_p=0.5, seed=4)
    gen = make_generator(params, "cpu")
    drawn = {sample(x, [params], [gen], [[]])[0] for _ in range(300)}
    # over the top 2 renormalized (0.57, 0.43) the 0.5 nucleus is the first token alone
    assert drawn == {0}


def test_every_bit_of_a_seed_counts() -> None:
    """Torch's CPU generator alone keeps a seed's low 32 bits: 0 and 2**32 would draw alike."""
    def draws(seed: int) -> list[float]:
        return torch.rand(8, generator=make_generator(SamplingParams(seed=seed), "cpu")).tolist()

    seeds = [0, 1, 2**32, 2**32 + 1, 2**63 - 1, -1, -(2**63)]
    assert len({tuple(draws(s)) for s in seeds}) == len(seeds)
    assert draws(2**32) == draws(2**32)


def test_logprobs_are_the_raw_distributions_each_row_with_its_own_top():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    found = token_logprobs(logits, [0, 2], [1, 3], [2, 0])
    expected = torch.log_softmax(logits, dim=-1)
    assert found[0][0] == pytest.approx(expected[0, 1].item())
    assert [i for i, _ in found[0][1]] == [0, 1]
    assert [v for _, v in found[0][1]] == pytest.approx(expected[0, :2].tolist())
    assert found[1] == (pytest.approx(math.log(0.25)), [])
    masked = torch.tensor([[0.0, float("-inf"), float("-inf")]])
    [(chosen, top)] = token_logprobs(masked, [0], [1], [3])
    assert chosen == -9999.0 and sorted(top) == [(0, 0.0), (1, -9999.0), (2, -9999.0)]


def test_logit_bias_moves_greedy_and_sampled_rows_but_not_the_raw_logits():
    raw = logits(2, seed=3)
    before = raw.clone()
    worst = [int(i) for i in raw.argmin(dim=-1)]
    best = [int(i) for i in raw.argmax(dim=-1)]
    params = [SamplingParams(temperature=0, logit_bias={worst[0]: 100.0}),
              SamplingParams(temperature=1.0, seed=1, logit_bias={best[1]: -100.0, worst[1]: 100.0})]
    tokens = sample(raw, params, [make_generator(p, "cpu") for p in params], [[], []])
    assert tokens == worst
    assert torch.equal(raw, before), "log-probabilities are read from the model's own logits"


def test_a_grammar_mask_limits_greedy_and_sampled_rows_and_leaves_other_rows_alone():
    raw = logits(3, seed=4)
    before = raw.clone()
    allowed = torch.zeros(V, dtype=torch.bool)
    allowed[[7, 11, 13]] = True
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.5, seed=2), SamplingParams(temperature=0)]
    gens = [make_generator(p, "cpu") for p in params]
    for _ in range(30):
        tokens = sample(raw, params, gens, [[], [], []], grammar=([0, 1], ~torch.stack([allowed, allowed])))
        assert tokens[0] == [7, 11, 13][int(raw[0, [7, 11, 13]].argmax())]
        assert tokens[1] in (7, 11, 13)
        assert tokens[2] == int(raw[2].argmax())
    assert torch.equal(raw, before)


def test_a_ban_that_would_leave_the_grammar_nothing_gives_way():
    """``min_tokens`` bans EOS (1) early; where the grammar allows only EOS and a stop token,
    the ban gives way rather than leave the row without a token the grammar takes."""
    x = torch.zeros(1, V)
    x[0, 5] = 10.0
    only_ends = torch.zeros(V, dtype=torch.bool)
    only_ends[[1, 2]] = True
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[2])
    assert sample(x, [params], [None], [[]], eos_token_ids={1}, grammar=([0], ~only_ends[None])) in ([1], [2])
    partly = only_ends.clone()
    partly[9] = True
    assert sample(x, [params], [None], [[]], eos_token_ids={1}, grammar=([0], ~partly[None])) == [9]
