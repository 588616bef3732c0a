"""The batch engine: continuous batching over a paged KV cache, for throughput-first pools."""

from __future__ import annotations

from typing import Any

from engines.paged.engine import PagedEngine, PagedOptions
from engines.runtime.loader import load_model

__all__ = ["PagedEngine", "PagedOptions", "create"]


def create(model: str, dtype: str = "auto", device: str = "auto", **options: Any) -> PagedEngine:
    """Load ``model`` and build the engine; ``options`` are :class:`PagedOptions` fields
    (block_size, num_blocks or kv_cache_bytes, max_num_seqs, max_batched_tokens,
    enable_prefix_caching)."""
    return PagedEngine(load_model(model, dtype=dtype, device=device), PagedOptions(**options))
