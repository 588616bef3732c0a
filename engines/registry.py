"""Engine names to factories. Imports are lazy so that a sim worker never loads torch."""

from __future__ import annotations

import importlib
import os
from typing import Any

from engines.base import Engine

ENGINES = {"sim": "engines.sim", "stream": "engines.stream", "paged": "engines.paged"}
TORCH_ENGINES = {"stream", "paged"}


def quiet_model_loading() -> None:
    """Progress bars from model loading would break the one-JSON-object-a-line logs."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def create_engine(name: str, model: str | None, options: dict[str, Any], threads: int | None = None) -> Engine:
    """Build engine ``name``; ``threads`` pins torch's intra-op threads of the engines that
    run on torch (the sim engine never imports it)."""
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}")
    quiet_model_loading()
    try:
        module = importlib.import_module(ENGINES[name])
    except ImportError as exc:
        raise RuntimeError(
            f"the {name} engine needs the engines extra (pip install 'slogate[engines]'): {exc}"
        ) from exc
    if threads is not None and name in TORCH_ENGINES:
        import torch

        torch.set_num_threads(threads)
    return module.create(model, **options)
