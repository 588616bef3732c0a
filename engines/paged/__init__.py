"""The batch engine: continuous batching over a paged KV cache, for throughput-first pools."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from engines.paged.engine import PagedEngine, PagedOptions
from engines.runtime.loader import load_model

__all__ = ["PagedEngine", "PagedOptions", "create"]


def create(model: str | None, dtype: str = "auto", device: str = "auto", **options: Any) -> PagedEngine:
    """Load ``model`` (a local directory or hub id) and build the engine; ``options`` are
    :class:`PagedOptions` fields (block_size, num_blocks or kv_cache_bytes, max_num_seqs,
    max_batched_tokens, enable_prefix_caching)."""
    if not model:
        raise ValueError("the paged engine needs a model (a local directory or hub id)")
    known = {f.name for f in fields(PagedOptions)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown paged engine options: {', '.join(unknown)}; expected {', '.join(sorted(known))}")
    return PagedEngine(load_model(model, dtype=dtype, device=device), PagedOptions(**options))
