"""The streaming engine: latency first, for interactive requests."""

from __future__ import annotations

import inspect
from typing import Any

from engines.runtime.loader import load_model
from engines.stream.engine import StreamEngine

_OPTIONS = set(inspect.signature(StreamEngine).parameters) - {"loaded"}


def create(model: str | None, dtype: str = "auto", device: str = "auto", **options: Any) -> StreamEngine:
    """Load ``model`` (a local directory or hub id) and build the engine. ``options`` are
    :class:`StreamEngine` arguments: max_batch (8), step_budget_ms (20),
    prefill_chunk_tokens (None: sized from measured cost), min_prefill_chunk (16),
    max_prefill_chunk (1024), enforce_deadline (False), warmup (True)."""
    if not model:
        raise ValueError("the stream engine needs a model (a local directory or hub id)")
    unknown = sorted(set(options) - _OPTIONS)
    if unknown:
        raise ValueError(f"unknown stream engine options: {', '.join(unknown)}; expected {', '.join(sorted(_OPTIONS))}")
    return StreamEngine(load_model(model, dtype=dtype, device=device), **options)


__all__ = ["StreamEngine", "create"]
