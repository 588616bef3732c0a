"""Paged attention as a transformers attention function.

The model runs with every scheduled token flattened into one batch row. Each layer hands its
new keys and values to :func:`paged_attention`, which writes them into the block pool at the
step's slot mapping and then attends each sequence over its own blocks: all one-token queries
(decodes) in one batched call over their gathered, padded contexts, and each multi-token
prefill chunk in its own causal call. The metadata arrives through the model's forward
kwargs, so transformers' model definitions are used unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

ATTN_IMPLEMENTATION = "slogate_paged"


@dataclass
class PrefillSpan:
    start: int
    end: int
    context_slots: torch.Tensor | None
    """Cache slots of the whole context when part of it was computed earlier; None when the
    chunk is the whole context so far (attend over the fresh keys directly)."""
    mask: torch.Tensor | None


@dataclass
class PagedMetadata:
    kv_cache: torch.Tensor
    """[2, layers, slots, kv_heads, head_dim]"""
    slot_mapping: torch.Tensor
    num_decodes: int
    """The first ``num_decodes`` tokens are one-token queries."""
    decode_slots: torch.Tensor | None
    """[num_decodes, max_context] cache slots of each decode's context, padded."""
    decode_mask: torch.Tensor | None
    """[num_decodes, 1, 1, max_context] True where the padded context is real."""
    prefills: list[PrefillSpan]


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    meta: PagedMetadata | None = kwargs.get("paged")
    if meta is None:
        raise RuntimeError("a model set to paged attention runs only through the paged model runner")
    k_cache = meta.kv_cache[0, module.layer_idx]
    v_cache = meta.kv_cache[1, module.layer_idx]
    k_cache.index_copy_(0, meta.slot_mapping, key[0].transpose(0, 1))
    v_cache.index_copy_(0, meta.slot_mapping, value[0].transpose(0, 1))
    gqa = query.shape[1] != key.shape[1]
    q = query[0]
    out = query.new_empty(q.shape[1], q.shape[0], q.shape[2])
    b = meta.num_decodes
    if b:
        k = k_cache[meta.decode_slots].transpose(1, 2)
        v = v_cache[meta.decode_slots].transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q[:, :b].transpose(0, 1).unsqueeze(2), k, v, attn_mask=meta.decode_mask, scale=scaling, enable_gqa=gqa
        )
        out[:b] = o.squeeze(2)
    for span in meta.prefills:
        qp = q[:, span.start : span.end].unsqueeze(0)
        if span.context_slots is None:
            kp, vp = key[:, :, span.start : span.end], value[:, :, span.start : span.end]
        else:
            kp = k_cache[span.context_slots].transpose(0, 1).unsqueeze(0)
            vp = v_cache[span.context_slots].transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(
            qp, kp, vp, attn_mask=span.mask, is_causal=span.mask is None, scale=scaling, enable_gqa=gqa
        )
        out[span.start : span.end] = o[0].transpose(0, 1)
    return out.unsqueeze(0), None


def _no_mask(*args, **kwargs) -> None:
    """Masks are built per sequence inside :func:`paged_attention`, never as one dense tensor."""
    return None


def register() -> None:
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
