"""The batch engine: continuous batching over a paged KV cache, for throughput-first pools."""

from __future__ import annotations

from typing import Any

from engines.paged.engine import PagedEngine, PagedOptions
from engines.runtime.loader import load_engine

__all__ = ["OPTIONS", "PagedEngine", "PagedOptions", "create"]

OPTIONS = PagedOptions


def create(model: str | None, dtype: str = "auto", device: str = "auto", **options: Any) -> PagedEngine:
    """Load ``model`` (a local directory or hub id) and build the engine; ``options`` are
    :class:`PagedOptions` fields (block_size, num_blocks or kv_cache_bytes, max_num_seqs,
    max_batched_tokens, enable_prefix_caching)."""
    return load_engine("paged", PagedEngine, PagedOptions, model, dtype, device, options)
