"""Layers with fused projections (:mod:`engines.paged.fused`) compute what the model's own
forward does, for each layout they take: Llama, Mistral, Qwen2 (biased query, key and value)
and Qwen3 (a norm on each head's query and key)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from engines.paged.block_manager import BlockManager
from engines.paged.fused import fuse_projections
from engines.paged.model_runner import ModelRunner
from engines.paged.sequence import Sequence
from engines.runtime.packed_linear import pack_linears
from slogate.protocol import SamplingParams
from tests.engines.test_paged_step_graphs import schedule_parts

BLOCK = 4
BLOCKS = 64
SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
MODELS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**SHAPE)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**SHAPE)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**SHAPE)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**SHAPE, head_dim=16)),
}


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    built = MODELS[kind]().eval()
    if kind == "qwen2":  # transformers starts biases at zero: give them values a lost one would show
        for layer in built.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    return built


def _seq(rid: str, n: int) -> Sequence:
    return Sequence(rid, [(13 * i + 7 * len(rid)) % 290 + 5 for i in range(n)], SamplingParams(max_tokens=4))


def _steps(runner: ModelRunner, own_forward: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Two prompts, then a step of a decode, a prompt chunk from the middle and a new prompt:
    logits by request and the KV cache, from the runner or from the model's own forward."""
    blocks = BlockManager(BLOCKS, BLOCK)
    a, b, c = _seq("a", 13), _seq("bb", 30), _seq("ccc", 9)
    logits: dict[str, torch.Tensor] = {}
    for parts in ([(a, 0, 12), (b, 0, 16)], [(a, 12, 1), (b, 16, 14), (c, 0, 9)]):
        sched = schedule_parts(blocks, parts)
        with torch.inference_mode():
            if own_forward:
                inputs = runner.prepare(sched)
                rows = runner.model(input_ids=inputs.input_ids.unsqueeze(0), position_ids=inputs.positions.unsqueeze(0),
                                    logits_to_keep=inputs.logit_rows, use_cache=False, paged=inputs.meta).logits[0]
                sampled = inputs.sampled
            else:
                sampled, rows = runner.run(sched)
        logits.update({sched.seqs[i].request_id: row.clone() for i, row in zip(sampled, rows)})
        for seq, start, n in parts:
            seq.num_computed_tokens = start + n
    return logits, runner.kv_cache


@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_fused_layers_give_the_models_own_logits_and_cache(kind: str, packed: bool) -> None:
    model = _model(kind)
    fused = copy.deepcopy(model)
    assert fuse_projections(fused)
    attn, mlp = fused.model.layers[0].self_attn, fused.model.layers[0].mlp
    assert not any(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj")) and not hasattr(mlp, "gate_proj")
    if packed and not pack_linears(fused):
        pytest.skip("oneDNN cannot pack weights on this machine")
    reference, reference_cache = _steps(ModelRunner(model, BLOCKS, BLOCK, kernel="torch"), own_forward=True)
    runner = ModelRunner(fused, BLOCKS, BLOCK, kernel="torch")
    got, cache = _steps(runner, own_forward=False)
    assert sorted(got) == sorted(reference) == ["a", "bb", "ccc"]
    for rid, row in reference.items():
        torch.testing.assert_close(got[rid], row, atol=1e-5, rtol=1e-5, msg=rid)
    torch.testing.assert_close(cache, reference_cache, atol=1e-5, rtol=1e-5)
    assert cache.abs().sum() > 0


def test_fusing_twice_is_a_no_op_and_other_models_or_packed_weights_are_left_alone() -> None:
    model = _model("llama")
    assert fuse_projections(model)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.out_features == 64 + 2 * 2 * 16
    assert fuse_projections(model) and model.model.layers[0].self_attn.qkv_proj is qkv
    packed = _model("llama")
    if pack_linears(packed):
        assert not fuse_projections(packed)
        assert hasattr(packed.model.layers[0].self_attn, "q_proj"), "untouched"
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=64))
    assert not fuse_projections(gpt2)
