from __future__ import annotations

import pytest

from policies.classify import UnknownClass, classify
from policies.config import load

CFG = load({})


def test_header_beats_everything() -> None:
    assert classify("batch", "interactive", "interactive", True, 1, 10, CFG) == ("batch", "header")
    assert classify(" Interactive ", "batch", "batch", False, 4096, 10**6, CFG) == ("interactive", "header")


def test_key_default_beats_model_route_and_heuristics() -> None:
    assert classify(None, "batch", "interactive", True, 1, 10, CFG) == ("batch", "key-default")


def test_model_route_beats_heuristics() -> None:
    assert classify(None, None, "batch", True, 1, 10, CFG) == ("batch", "model-route")
    assert classify("", None, "interactive", False, 4096, 10**6, CFG) == ("interactive", "model-route")


def test_unknown_header_class_is_the_clients_error() -> None:
    with pytest.raises(UnknownClass, match="urgent"):
        classify("urgent", None, None, True, 1, 10, CFG)


@pytest.mark.parametrize(
    ("stream", "max_tokens", "prompt_chars", "expected"),
    [
        (True, 128, 2_000, ("interactive", "heuristic:stream")),
        (True, 4096, 100_000, ("batch", "heuristic:prompt_chars>8000")),
        (True, 414, 3_000, ("batch", "heuristic:max_tokens>=256")),
        (True, 8, 100_000, ("interactive", "heuristic:max_tokens<=64")),
        (False, 64, 100_000, ("interactive", "heuristic:max_tokens<=64")),
        (False, 65, 8001, ("batch", "heuristic:prompt_chars>8000")),
        (False, 256, 100, ("batch", "heuristic:max_tokens>=256")),
        (False, 255, 8000, ("batch", "default")),
        (False, None, 100, ("batch", "default")),
        (False, None, 9000, ("batch", "heuristic:prompt_chars>8000")),
    ],
)
def test_heuristics_in_order(stream: bool, max_tokens: int | None, prompt_chars: int, expected: tuple) -> None:
    assert classify(None, None, None, stream, max_tokens, prompt_chars, CFG) == expected


def test_heuristic_thresholds_and_default_come_from_config() -> None:
    cfg = load({"classification": {"default_class": "interactive",
                                   "heuristics": {"interactive_max_tokens": 8, "batch_max_tokens": 100}}})
    assert classify(None, None, None, False, 8, 10, cfg) == ("interactive", "heuristic:max_tokens<=8")
    assert classify(None, None, None, False, 9, 10, cfg) == ("interactive", "default")
    assert classify(None, None, None, False, 100, 10, cfg) == ("batch", "heuristic:max_tokens>=100")
