"""Paged attention as a transformers attention function.

The model runs with every scheduled token flattened into one batch row. Each layer hands its
new keys and values to :func:`paged_attention`, which writes them into the block pool at the
step's slot mapping and then attends each sequence over its own blocks. One-token queries
(decodes) run batched, in groups of similar context length so that padding stays small; each
multi-token prefill chunk runs in its own causal call. The metadata arrives through the
model's forward kwargs, so transformers' model definitions are used unchanged.

The pool is laid out [kv_heads, slots, head_dim] per layer: the step's keys arrive in that
layout (no transpose to store them), and one ``index_select`` of whole blocks (contiguous
rows of block_size * head_dim) gathers a group's contexts straight into the
[seqs, kv_heads, context, head_dim] shape attention wants. Decodes fold the
query heads that share a key-value head into the query dimension, so grouped-query attention
never copies keys per query head. Where the C++ kernel of :mod:`engines.paged.native` is
built, decodes skip the gather altogether: it reads each sequence's blocks in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from engines.paged import native

ATTN_IMPLEMENTATION = "slogate_paged"


@dataclass
class DecodeGroup:
    start: int
    end: int
    gather: torch.Tensor
    """Rows of the layer's pool viewed as [kv_heads * blocks, block_size * head_dim] (one row
    is one head's block), in [seqs, kv_heads, blocks] order."""
    padding: torch.Tensor
    """[seqs, 1, 1, blocks * block_size], True where the context is padding (past a
    sequence's end)."""


@dataclass
class PrefillSpan:
    start: int
    end: int
    gather: torch.Tensor | None
    """Pool rows (as for :class:`DecodeGroup`) of the whole context's blocks, [kv_heads,
    blocks] order; None when the chunk is the whole context so far (attend over the fresh
    keys directly)."""
    mask: torch.Tensor | None
    """[chunk, blocks * block_size]: causal, and hiding the unused end of the last block."""


@dataclass
class PagedMetadata:
    kv_cache: torch.Tensor
    """[2, layers, kv_heads, slots, head_dim], slot = block * block_size + offset"""
    block_size: int
    slot_mapping: torch.Tensor
    decodes: list[DecodeGroup]
    prefills: list[PrefillSpan]
    decode_tables: torch.Tensor | None = None
    """For the native kernel (``decodes`` is then empty): [decodes, blocks] int32 block
    tables, padded, of the step's first rows (one decode token each)."""
    decode_lengths: torch.Tensor | None = None
    """[decodes] int32 context lengths, the new token included."""


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
    k_cache.index_copy_(1, meta.slot_mapping, key[0])
    v_cache.index_copy_(1, meta.slot_mapping, value[0])
    kv_heads, _, head_dim = k_cache.shape
    k_rows = k_cache.view(-1, meta.block_size * head_dim)
    v_rows = v_cache.view(-1, meta.block_size * head_dim)
    heads = query.shape[1]
    q = query[0].transpose(0, 1)
    out = query.new_empty(q.shape)
    scale = scaling if scaling is not None else head_dim**-0.5
    if meta.decode_tables is not None:
        n = meta.decode_tables.shape[0]
        native.paged_decode(
            q[:n].contiguous(), k_cache, v_cache, meta.decode_tables, meta.decode_lengths, meta.block_size, scale, out[:n]
        )
    for g in meta.decodes:
        n = g.end - g.start
        k = k_rows.index_select(0, g.gather).view(n, kv_heads, -1, head_dim)
        v = v_rows.index_select(0, g.gather).view(n, kv_heads, -1, head_dim)
        qg = q[g.start : g.end].reshape(n, kv_heads, heads // kv_heads, head_dim)
        out[g.start : g.end] = _decode_attention(qg, k, v, g.padding, scale).view(n, heads, head_dim)
    for span in meta.prefills:
        qp = query[:, :, span.start : span.end]
        if span.gather is None:
            kp, vp = key[:, :, span.start : span.end], value[:, :, span.start : span.end]
        else:
            kp = k_rows.index_select(0, span.gather).view(1, kv_heads, -1, head_dim)
            vp = v_rows.index_select(0, span.gather).view(1, kv_heads, -1, head_dim)
        o = F.scaled_dot_product_attention(
            qp, kp, vp, attn_mask=span.mask, is_causal=span.mask is None, scale=scaling, enable_gqa=heads != kv_heads
        )
        out[span.start : span.end] = o[0].transpose(0, 1)
    return out.unsqueeze(0), None


def _decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, padding: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query token per sequence: two batched matmuls around a float32 softmax (as
    transformers' eager attention does). For one-row queries this is about twice as fast on
    CPU as ``scaled_dot_product_attention``, whose flash kernel is built for long queries."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float().mul_(scale).masked_fill_(padding, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)


def register() -> None:
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)


def check_supported(config: Any) -> None:
    """Refuse a model whose attention does more than this computes: soft-capped scores (Gemma
    2's tanh before the softmax) would be served uncapped, every token's distribution off the
    model's, with no error to tell."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    softcap = getattr(text_config, "attn_logit_softcapping", None)
    if softcap:
        raise ValueError(f"paged attention has no soft-capping of attention scores, which this model uses "
                         f"(attn_logit_softcapping={softcap})")
