"""A step run a layer at a time that takes newcomers in between layers
(:mod:`engines.paged.layered`): the logits and the KV cache must be those of the same requests
run in one step from its start (to float rounding: the newcomers' matmuls run on fewer rows),
whichever layer they joined at."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, GPT2Config, GPT2LMHeadModel, LlamaForCausalLM

from engines.paged.block_manager import BlockManager
from engines.paged.layered import Decoder
from engines.paged.model_runner import ModelRunner
from engines.paged.scheduler import Schedule
from engines.paged.sequence import Sequence
from slogate.protocol import SamplingParams
from tests.engines.test_paged_step_graphs import schedule_parts

BLOCK = 4
BLOCKS = 64
LAYERS = 4


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> torch.nn.Module:
    """The tiny model's shape with four layers, so newcomers can join at several depths."""
    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.num_hidden_layers = LAYERS
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def _seq(rid: str, n: int) -> Sequence:
    return Sequence(rid, [(13 * i + 3 * len(rid)) % 200 + 5 for i in range(n)], SamplingParams(max_tokens=4))


def _step(model: torch.nn.Module, kernel: str, joins: dict[int, list[tuple[int, int]]] | None,
          upfront: list[tuple[int, int]] = ()):
    """Two decodes and a prompt chunk, with the newcomers (index, tokens) that join at each
    layer in ``joins`` (None: no join at all) or are in the step from its start; returns the
    logits by request, the KV cache and the layers join was asked at."""
    runner = ModelRunner(model, BLOCKS, BLOCK, kernel=kernel)
    blocks = BlockManager(BLOCKS, BLOCK)
    a, b, c = _seq("a", 13), _seq("bb", 30), _seq("ccc", 40)
    newcomers = [_seq("new0", 9), _seq("new1", 17), _seq("new2", 6)]
    runner.run(schedule_parts(blocks, [(a, 0, 12), (b, 0, 29), (c, 0, 16)]))
    sched = schedule_parts(blocks, [(a, 12, 1), (c, 16, 11), (b, 29, 1)] + [(newcomers[i], 0, n) for i, n in upfront])
    asked: list[int] = []

    def join(layer: int) -> Schedule | None:
        asked.append(layer)
        parts = [(newcomers[i], 0, n) for i, n in joins.get(layer, [])]
        return schedule_parts(blocks, parts) if parts else None

    sampled, logits = runner.run(sched, join if joins is not None else None)
    by_request = {sched.seqs[i].request_id: row for i, row in zip(sampled, logits)}
    return by_request, runner.kv_cache, asked


@pytest.mark.parametrize("kernel", ["torch", "auto"])
@pytest.mark.parametrize("joins", [
    {1: [(0, 9)]},
    {3: [(0, 9), (1, 17)]},
    {1: [(0, 9)], 2: [(2, 6)], 3: [(1, 12)]},
], ids=["one-after-the-first-layer", "two-before-the-last", "one-at-each-layer"])
def test_a_newcomer_joining_between_layers_gets_the_logits_and_cache_of_a_whole_step(model, kernel, joins):
    joined, joined_cache, asked = _step(model, kernel, joins)
    everyone = [item for layer in sorted(joins) for item in joins[layer]]
    whole, whole_cache, _ = _step(model, kernel, None, upfront=everyone)

    assert asked == list(range(1, LAYERS)), "join is asked between every two layers"
    assert sorted(joined) == sorted(whole)
    assert "bb" in joined and "a" in joined and "ccc" not in joined, "c's chunk stops short of its end"
    assert ("new1" in joined) == any(n == 17 for _, n in everyone), "a partial chunk samples nothing"
    for rid, row in whole.items():
        torch.testing.assert_close(joined[rid], row, atol=1e-4, rtol=1e-4, msg=rid)
        assert joined[rid].argmax() == row.argmax(), rid
    torch.testing.assert_close(joined_cache, whole_cache, atol=1e-4, rtol=1e-4)
    assert joined_cache.abs().sum() > 0


def test_a_step_no_one_joins_is_the_whole_model_forward(model):
    plain, plain_cache, _ = _step(model, "torch", None)
    layered, layered_cache, asked = _step(model, "torch", {})
    assert asked == [1, 2, 3] and set(layered) == set(plain) == {"a", "bb"}
    for rid, row in plain.items():
        torch.testing.assert_close(layered[rid], row, atol=1e-5, rtol=1e-5, msg=rid)
    torch.testing.assert_close(layered_cache, plain_cache, atol=1e-5, rtol=1e-5)


def test_models_laid_out_otherwise_run_whole():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=64))
    assert Decoder.of(gpt2) is None
