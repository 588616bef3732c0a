"""Decoder layers with their query, key and value projections in one linear layer, and their
MLP's gate and up projections in another, run by a forward of our own.

Why: on CPU a step pays for every operator it issues, and transformers' layer issues many
around its seven linear layers (views, transposes, the attention interface's keyword
plumbing), and the model's forward more around the stack. Three linears where there were
seven, reading the same weights in fewer and larger calls, and a layer forward with only the
operators the arithmetic needs, made the forward of the tiny model 2.3x as fast (0.51 against
1.18 ms for one decode) and of the ~100M model in bf16 15-19% (13.4 against 16.5 ms for one
decode, 20.4 against 23.8 ms for a 40-token prompt; 2 threads, AMX host), with logits equal to
the bit; a whole engine step, its inputs built too, 20-30% (README). Each operator the forward
keeps is the one transformers runs (its norm modules, its rotary function, its activation), on
the same values in the same order, so the output is the model's.

Only the :data:`LAYOUTS` qualify, and only on CPU: on a GPU steps replay as CUDA graphs of
transformers' forward (:mod:`engines.paged.step_graphs`), which issue nothing per operator. A
fused model runs only through :class:`FusedLayer`; its layers lose the projections that were
fused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from engines.paged.attention import PagedMetadata, paged_attention

LAYOUTS = frozenset({"llama", "mistral", "qwen2", "qwen3"})
"""Model types whose forward is exactly embedding, layers, norm and head, each layer norm,
attention, residual, norm, gated MLP and residual."""

_ATTENTION = ("q_proj", "k_proj", "v_proj")
_MLP = ("gate_proj", "up_proj")


def fuse_projections(model: PreTrainedModel) -> bool:
    """Fuse every decoder layer's projections in place; whether the model's layers are now
    fused (False, untouched, where its type is not one of :data:`LAYOUTS` or a projection is
    not a plain linear layer, as after packing)."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if model.config.model_type not in LAYOUTS or layers is None:
        return False
    if all(hasattr(layer.self_attn, "qkv_proj") for layer in layers):
        return True
    if not all(_plain(layer.self_attn, _ATTENTION) and _plain(layer.mlp, _MLP) for layer in layers):
        return False
    for layer in layers:
        layer.self_attn.qkv_proj = _concatenated(layer.self_attn, _ATTENTION)
        layer.mlp.gate_up_proj = _concatenated(layer.mlp, _MLP)
    return True


def _plain(module: torch.nn.Module, names: tuple[str, ...]) -> bool:
    return all(isinstance(getattr(module, name, None), torch.nn.Linear) for name in names)


def _concatenated(module: torch.nn.Module, names: tuple[str, ...]) -> torch.nn.Linear:
    """One linear layer whose outputs are those of ``names`` in order; they are removed."""
    parts = [getattr(module, name) for name in names]
    weight = torch.cat([p.weight.detach() for p in parts])
    fused = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=any(p.bias is not None for p in parts),
                            device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(weight)
        if fused.bias is not None:
            fused.bias.copy_(torch.cat([p.bias.detach() if p.bias is not None else weight.new_zeros(p.out_features)
                                        for p in parts]))
    for name in names:
        delattr(module, name)
    return fused


@dataclass
class FusedLayer:
    """A fused decoder layer, called as transformers' layer is by :class:`engines.paged.layered.Decoder`."""

    layer: torch.nn.Module
    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, layer: torch.nn.Module) -> FusedLayer | None:
        attn = layer.self_attn
        if not hasattr(attn, "qkv_proj"):
            return None
        config = attn.config
        heads = config.num_attention_heads
        return cls(layer, heads, getattr(config, "num_key_value_heads", None) or heads, attn.head_dim)

    def __call__(self, hidden: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                 paged: PagedMetadata) -> torch.Tensor:
        layer, attn, mlp = self.layer, self.layer.self_attn, self.layer.mlp
        tokens = hidden.shape[1]
        qkv = attn.qkv_proj(layer.input_layernorm(hidden))
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        query = qkv[..., :q_size].view(1, tokens, self.heads, self.head_dim)
        key = qkv[..., q_size : q_size + kv_size].view(1, tokens, self.kv_heads, self.head_dim)
        value = qkv[..., q_size + kv_size :].view(1, tokens, self.kv_heads, self.head_dim)
        if getattr(attn, "q_norm", None) is not None:  # Qwen3 normalizes each head's query and key
            query, key = attn.q_norm(query), attn.k_norm(key)
        cos, sin = position_embeddings
        query, key = apply_rotary_pos_emb(query.transpose(1, 2), key.transpose(1, 2), cos, sin)
        out, _ = paged_attention(attn, query, key, value.transpose(1, 2), None, scaling=attn.scaling, paged=paged)
        hidden = hidden + attn.o_proj(out.reshape(1, tokens, q_size))
        gate, up = mlp.gate_up_proj(layer.post_attention_layernorm(hidden)).chunk(2, dim=-1)
        return hidden + mlp.down_proj(mlp.act_fn(gate) * up)
