"""The streaming engine: latency first, for interactive requests."""

from __future__ import annotations

from typing import Any

from engines.runtime.loader import load_model
from engines.stream.engine import StreamEngine


def create(model: str, **options: Any) -> StreamEngine:
    """Load ``model`` and build the engine. Options: ``dtype`` ("auto"), ``device`` ("auto"),
    ``max_batch`` (8), ``step_budget_ms`` (20), ``prefill_chunk_tokens`` (None: sized from
    measured cost), ``min_prefill_chunk`` (16), ``enforce_deadline`` (True), ``warmup`` (True)."""
    loaded = load_model(model, dtype=options.pop("dtype", "auto"), device=options.pop("device", "auto"))
    return StreamEngine(loaded, **options)


__all__ = ["StreamEngine", "create"]
