"""A step run a layer at a time that pauses between layers while newcomers' prompts run
(:mod:`engines.paged.layered`): the step, the newcomers and the KV cache must come out as they
would have with the step and the newcomers' passes run one after the other, whichever layers
it paused at."""

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


def _step(model: torch.nn.Module, kernel: str, cut_ins: dict[int, list[tuple[int, int]]] | None,
          paused: bool = True):
    """Two decodes and a prompt chunk, with the newcomers (index, tokens) whose passes run at
    each layer in ``cut_ins``: during the step (``paused``; None: run whole, without pausing)
    or after it. Returns the logits by request, the KV cache and the layers the step paused at."""
    runner = ModelRunner(model, BLOCKS, BLOCK, kernel=kernel)
    blocks = BlockManager(BLOCKS, BLOCK)
    a, b, c = _seq("a", 13), _seq("bb", 30), _seq("ccc", 40)
    newcomers = [_seq("new0", 9), _seq("new1", 17), _seq("new2", 6)]
    runner.run(schedule_parts(blocks, [(a, 0, 12), (b, 0, 29), (c, 0, 16)]))
    sched = schedule_parts(blocks, [(a, 12, 1), (c, 16, 11), (b, 29, 1)])
    logits: dict[str, torch.Tensor] = {}
    asked: list[int] = []

    def run(batch: Schedule) -> None:
        sampled, rows = runner.run(batch)
        logits.update({batch.seqs[i].request_id: row for i, row in zip(sampled, rows)})

    def cut_in(layer: int) -> None:
        asked.append(layer)
        if parts := [(newcomers[i], 0, n) for i, n in (cut_ins or {}).get(layer, [])]:
            run(schedule_parts(blocks, parts))

    sampled, rows = runner.run(sched, cut_in if paused and cut_ins is not None else None)
    logits.update({sched.seqs[i].request_id: row for i, row in zip(sampled, rows)})
    if not paused:
        for layer in sorted(cut_ins):
            cut_in(layer)
    return logits, runner.kv_cache, asked


@pytest.mark.parametrize("kernel", ["torch", "auto"])
@pytest.mark.parametrize("cut_ins", [
    {1: [(0, 9)]},
    {3: [(0, 9), (1, 17)]},
    {1: [(0, 9)], 2: [(2, 6)], 3: [(1, 12)]},
], ids=["one-after-the-first-layer", "two-before-the-last", "one-at-each-layer"])
def test_a_step_paused_for_newcomers_computes_what_it_and_their_passes_would_one_after_the_other(
        model, kernel, cut_ins):
    paused, paused_cache, asked = _step(model, kernel, cut_ins)
    after, after_cache, _ = _step(model, kernel, cut_ins, paused=False)

    assert asked == list(range(1, LAYERS)), "the step pauses between every two layers"
    everyone = [n for layer in cut_ins for n in cut_ins[layer]]
    assert sorted(paused) == sorted(after) == sorted(
        ["a", "bb"] + [f"new{i}" for i, n in everyone if (i, n) != (1, 12)]
    ), "a partial chunk samples nothing"
    for rid, row in after.items():
        torch.testing.assert_close(paused[rid], row, atol=1e-5, rtol=1e-5, msg=rid)
    torch.testing.assert_close(paused_cache, after_cache, atol=1e-5, rtol=1e-5)
    assert paused_cache.abs().sum() > 0


def test_a_step_that_never_pauses_for_anyone_computes_what_an_unpaused_step_does(model):
    plain, plain_cache, _ = _step(model, "torch", None)
    layered, layered_cache, asked = _step(model, "torch", {})
    assert asked == [1, 2, 3] and set(layered) == set(plain) == {"a", "bb"}
    for rid, row in plain.items():
        torch.testing.assert_close(layered[rid], row, atol=1e-5, rtol=1e-5, msg=rid)
    torch.testing.assert_close(layered_cache, plain_cache, atol=1e-5, rtol=1e-5)


def test_models_laid_out_otherwise_run_whole():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=64))
    assert Decoder.of(gpt2) is None
