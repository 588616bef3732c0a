"""Engine names to factories. Imports are lazy so that a sim worker never loads torch."""

from __future__ import annotations

import importlib
import inspect
import logging
import os
from dataclasses import fields
from functools import partial
from typing import Any

from engines.base import Engine
from engines.engine_process import Encoder, EngineProcess
from slogate import logs
from slogate.config import ENGINES as ENGINE_NAMES
from slogate.config import served_model_id

ENGINES = {name: f"engines.{name}" for name in ENGINE_NAMES}
TORCH_ENGINES = {"stream", "paged"}

log = logging.getLogger("slogate")


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


def create_engine(name: str, model: str | None, options: dict[str, Any], threads: int | None = None,
                  inherited: dict[str, Any] | None = None) -> Engine:
    """Build engine ``name``; ``threads`` pins torch's intra-op threads of the engines that
    run on torch (the sim engine never imports it). ``inherited`` are options written for
    another engine (a pool's, when ``slogate worker --engine`` names another): those this
    engine has too (``device``, ``kv_cache_bytes``) apply unless ``options`` sets them, and the
    rest are left out and named in the log, where this engine would refuse them."""
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
    if inherited:
        options = {**_shared(name, module, inherited), **options}
    return module.create(model, **options)


def _shared(name: str, module: Any, inherited: dict[str, Any]) -> dict[str, Any]:
    """What of ``inherited`` engine ``name`` takes: its options dataclass's fields and the
    keywords of its ``create`` (``dtype``, ``device``)."""
    keywords = [p for p in inspect.signature(module.create).parameters.values() if p.name != "model"]
    known = {f.name for f in fields(module.OPTIONS)} | {
        p.name for p in keywords if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    left_out = sorted(set(inherited) - known)
    if left_out:
        log.warning("the %s engine runs without %s: options of the pool's engine that it does not have", name,
                    ", ".join(left_out))
    return {key: value for key, value in inherited.items() if key in known}


def start_engine_process(name: str, model: str | None, options: dict[str, Any], threads: int | None = None,
                         log_level: str = "info", log_format: str = "json",
                         inherited: dict[str, Any] | None = None) -> EngineProcess:
    """Build engine ``name`` in a process of its own (see :mod:`engines.engine_process`).
    This process loads the tokenizer while that one builds the engine (one start-up instead
    of two in a row), so prompts are tokenized beside the engine's steps."""
    encoder = partial(_prompt_encoder, model) if name in TORCH_ENGINES and model else None
    return EngineProcess(partial(_create_logged, name, model, options, threads, log_level, log_format, inherited),
                         encoder)


def _prompt_encoder(model: str) -> Encoder:
    from transformers import AutoTokenizer

    from engines.runtime.loader import encode_prompt

    return partial(encode_prompt, AutoTokenizer.from_pretrained(model), served_model_id(model))


def _create_logged(name: str, model: str | None, options: dict[str, Any], threads: int | None,
                   log_level: str, log_format: str, inherited: dict[str, Any] | None) -> Engine:
    logs.setup(log_level, log_format)
    return create_engine(name, model, options, threads, inherited)
