"""Which class a request belongs to, and why (the reason goes out in ``x-slogate-reason``).

The most explicit signal wins: the caller's header, then what the operator said about the API
key, then about the model, and only then guesses from the request's shape.
"""

from __future__ import annotations

from policies.config import CLASSES, PolicyConfig


class UnknownClass(ValueError):
    """The ``x-slogate-class`` header names no class: the client's error (400), not a guess."""


def classify(
    header_class: str | None,
    key_default: str | None,
    model_route: str | None,
    stream: bool,
    max_tokens: int | None,
    prompt_chars: int,
    cfg: PolicyConfig,
) -> tuple[str, str]:
    """Return ``(class, reason)``.

    ``key_default`` and ``model_route`` are what the gateway looked up (for instance with
    ``cfg.classification.key_classes.get(key_id)``); config validation already vouched for them.
    A missing ``max_tokens`` means "as long as the model goes", so it never looks short.
    """
    if header_class:
        cls = header_class.strip().lower()
        if cls not in CLASSES:
            raise UnknownClass(f"x-slogate-class must be one of {', '.join(CLASSES)}, got {header_class!r}")
        return cls, "header"
    if key_default:
        return key_default, "key-default"
    if model_route:
        return model_route, "model-route"
    rules = cfg.classification.heuristics
    if max_tokens is not None and max_tokens <= rules.interactive_max_tokens:
        return "interactive", f"heuristic:max_tokens<={rules.interactive_max_tokens}"
    # The size of the work outranks streaming: a long report is streamed for convenience, not
    # because someone waits on each token.
    if prompt_chars > rules.batch_prompt_chars:
        return "batch", f"heuristic:prompt_chars>{rules.batch_prompt_chars}"
    if max_tokens is not None and max_tokens >= rules.batch_max_tokens:
        return "batch", f"heuristic:max_tokens>={rules.batch_max_tokens}"
    if stream:
        return "interactive", "heuristic:stream"
    return cfg.classification.default_class, "default"
