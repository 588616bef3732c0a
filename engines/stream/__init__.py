"""The streaming engine: latency first, for interactive requests."""

from __future__ import annotations

from typing import Any

from engines.runtime.loader import load_engine
from engines.stream.engine import StreamEngine, StreamOptions

__all__ = ["OPTIONS", "StreamEngine", "StreamOptions", "create"]

OPTIONS = StreamOptions


def create(model: str | None, dtype: str = "auto", device: str = "auto", **options: Any) -> StreamEngine:
    """Load ``model`` (a local directory or hub id) and build the engine; ``options`` are
    :class:`StreamOptions` fields (max_batch, step_budget_ms, max_stall_ratio, min_chunk_tokens,
    short_prompt_tokens, prefill_chunk_tokens, max_step_tokens, block_size, kv_cache_bytes,
    num_blocks, enable_prefix_caching, pack_weights, cuda_graphs, cut_ins_per_step, warmup)."""
    return load_engine("stream", StreamEngine, StreamOptions, model, dtype, device, options)
