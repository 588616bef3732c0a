"""Engine names to factories. Imports are lazy so that a sim worker never loads torch."""

from __future__ import annotations

import importlib
from typing import Any

from engines.base import Engine

ENGINES = {"sim": "engines.sim", "stream": "engines.stream", "paged": "engines.paged"}


def create_engine(name: str, model: str | None, options: dict[str, Any]) -> Engine:
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}")
    try:
        module = importlib.import_module(ENGINES[name])
    except ImportError as exc:
        raise RuntimeError(
            f"the {name} engine needs the engines extra (pip install 'slogate[engines]'): {exc}"
        ) from exc
    return module.create(model, **options)
