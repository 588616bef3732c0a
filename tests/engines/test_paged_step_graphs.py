"""The static-shape step that CUDA graphs replay (:mod:`engines.paged.step_graphs`), run
eagerly here: the same logits as the model runner's own path for a step that mixes a decode,
a prompt chunk from the middle of its prompt and a whole prompt, with padding rows that write
nowhere but the scratch block. On a GPU the engine tests run it captured."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engines.paged.block_manager import BlockManager
from engines.paged.model_runner import ModelRunner
from engines.paged.scheduler import Schedule
from engines.paged.sequence import Sequence
from engines.paged.step_graphs import MAX_ROWS, StepGraphs, bucket
from slogate.protocol import SamplingParams

BLOCK = 4
BLOCKS = 64
SCRATCH = BLOCKS - 1


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _seq(rid: str, n: int) -> Sequence:
    return Sequence(rid, [(11 * i + len(rid)) % 200 + 5 for i in range(n)], SamplingParams(max_tokens=4))


def schedule_parts(blocks: BlockManager, parts: list[tuple[Sequence, int, int]]) -> Schedule:
    sched = Schedule()
    for seq, start, n in parts:
        if not seq.block_table:
            blocks.allocate(seq)
        seq.num_computed_tokens = start
        sched.add(seq, n)
    return sched


def test_a_mixed_step_gives_the_eager_logits_and_padding_touches_only_the_scratch_block(model):
    runner = ModelRunner(model, BLOCKS, BLOCK, kernel="torch")
    graphs = StepGraphs(model, runner.kv_cache, BLOCK, SCRATCH, max_context=256, capture=False)
    blocks = BlockManager(BLOCKS - 1, BLOCK)  # the scratch block is never handed out
    a, b, c = _seq("a", 21), _seq("b", 37), _seq("c", 9)
    runner.run(schedule_parts(blocks, [(a, 0, 20), (b, 0, 16)]))
    parts = [(a, 20, 1), (b, 16, 12), (c, 0, 9)]  # b's chunk stops short of its prompt's end
    sched = schedule_parts(blocks, parts)
    key = graphs.key(sched)
    assert key == (32, 8), "22 rows; 28 positions of b's 37 are reached: 7 of its 10 blocks"

    sampled, eager = runner.run(sched)
    before = runner.kv_cache.clone()
    graph_sampled, static = graphs.run(sched, key)

    assert graph_sampled == sampled == [0, 2]
    torch.testing.assert_close(static, eager, atol=1e-4, rtol=1e-4)
    assert static.argmax(-1).tolist() == eager.argmax(-1).tolist()
    changed = (runner.kv_cache != before).any(-1).flatten(0, 2).any(0).nonzero().flatten().tolist()
    step_slots = {s.block_table[p // BLOCK] * BLOCK + p % BLOCK
                  for s, start, n in parts for p in range(start, start + n)}
    scratch = set(range(SCRATCH * BLOCK, (SCRATCH + 1) * BLOCK))
    assert set(changed) <= step_slots | scratch
    assert set(changed) & scratch, "the padding rows wrote their keys into the scratch block"


def test_steps_too_large_for_a_graph_run_eagerly(model):
    runner = ModelRunner(model, BLOCKS, BLOCK, kernel="torch")
    graphs = StepGraphs(model, runner.kv_cache, BLOCK, SCRATCH, max_context=2048, capture=False)
    blocks = BlockManager(200, BLOCK)  # key() reads block tables only: no pool behind them
    assert [bucket(n) for n in (1, 2, 3, 16, 17)] == [1, 2, 4, 16, 32]
    fits = schedule_parts(blocks, [(_seq("fits", MAX_ROWS), 0, MAX_ROWS)])
    assert graphs.key(fits) == (MAX_ROWS, bucket(MAX_ROWS // BLOCK))
    first_chunk = schedule_parts(blocks, [(_seq("chunk", 200), 0, 8)])
    assert graphs.key(first_chunk) == (8, 2), "a chunk gathers the context it reaches, not its whole table"
    too_many = schedule_parts(blocks, [(_seq("long", MAX_ROWS + 1), 0, MAX_ROWS + 1)])
    assert graphs.key(too_many) is None
