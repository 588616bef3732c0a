from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from engines.runtime.detokenizer import IncrementalDecoder, OutputTracker
from slogate.protocol import SamplingParams

MIXED = "The gateway accepts 你好，世界。 🚀 launch 👍🏽 naïve café, 风险评分 done"
EOS = 1


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def run(tokenizer, text: str, **params) -> tuple[list[str], str | None, OutputTracker]:
    params.setdefault("max_tokens", 1000)
    tracker = OutputTracker(tokenizer, SamplingParams(**params), {EOS}, prompt_ids=[0])
    deltas, reason = [], None
    for token in ids_of(tokenizer, text):
        delta, reason = tracker.append(token)
        deltas.append(delta)
        if reason:
            break
    return deltas, reason, tracker


def test_multibyte_characters_really_span_tokens(tokenizer):
    pieces = [tokenizer.decode([t]) for t in ids_of(tokenizer, "你好🚀")]
    assert "\ufffd" in "".join(pieces)


def test_deltas_are_whole_characters_and_concatenate_to_the_text(tokenizer):
    deltas, reason, tracker = run(tokenizer, MIXED)
    assert reason is None
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + tracker.flush() == MIXED
    assert sum(1 for d in deltas if d == "") > 0, "some tokens must have been held back"


def test_decoder_flush_shows_an_incomplete_character_at_the_end(tokenizer):
    decoder = IncrementalDecoder(tokenizer)
    first_byte_of_rocket = ids_of(tokenizer, "🚀")[0]
    assert decoder.push(first_byte_of_rocket) == ""
    assert decoder.flush() == "\ufffd"


def test_stop_string_split_across_tokens_is_never_streamed(tokenizer):
    text = "risk score END of text"
    assert len(ids_of(tokenizer, " END")) > 1
    deltas, reason, tracker = run(tokenizer, text, stop=[" END"])
    assert reason == "stop"
    assert "".join(deltas) == "risk score"
    assert tracker.text == "risk score"
    assert all("E" not in d for d in deltas)


def test_chinese_stop_string_split_across_byte_tokens(tokenizer):
    deltas, reason, _ = run(tokenizer, MIXED, stop=["世界"])
    assert reason == "stop"
    assert "".join(deltas) == "The gateway accepts 你好，"


def test_prefix_of_a_stop_string_is_held_then_released(tokenizer):
    text = "风险评估 and more"
    deltas, reason, tracker = run(tokenizer, text, stop=["风险评分"])
    assert reason is None
    joined = ""
    for delta in deltas:
        joined += delta
        assert not (joined.endswith("风") or joined.endswith("风险") or joined.endswith("风险评"))
    assert joined + tracker.flush() == text


def test_earliest_of_several_stop_strings_wins(tokenizer):
    deltas, reason, _ = run(tokenizer, "alpha beta gamma delta", stop=["delta", "beta"])
    assert reason == "stop"
    assert "".join(deltas) == "alpha "


def test_max_tokens_finishes_with_length_and_flushes(tokenizer):
    n = len(ids_of(tokenizer, "你好"))
    deltas, reason, tracker = run(tokenizer, "你好 world", max_tokens=n)
    assert reason == "length"
    assert "".join(deltas) == "你好"
    assert len(tracker.token_ids) == n


def test_length_flushes_a_held_stop_prefix(tokenizer):
    n = len(ids_of(tokenizer, "risk score E"))
    deltas, reason, _ = run(tokenizer, "risk score END", stop=[" END"], max_tokens=n)
    assert reason == "length"
    assert "".join(deltas) == "risk score E"


def test_a_stop_string_begun_before_min_tokens_ends_the_output_after_it():
    class Words:
        def decode(self, ids, skip_special_tokens=True):
            return "".join([" the", " risk", " score", " of"][i] for i in ids)

    tracker = OutputTracker(Words(), SamplingParams(max_tokens=9, min_tokens=3, stop=["risk score"]), {EOS})
    assert tracker.append(0) == (" the", None)
    assert tracker.append(1) == (" ", None), "'risk' may begin the stop string: held"
    assert tracker.append(2) == ("", "stop")
    tracker = OutputTracker(Words(), SamplingParams(max_tokens=9, min_tokens=4, stop=["risk score"]), {EOS})
    assert [tracker.append(i) for i in (0, 1, 2, 3)] == [
        (" the", None), (" ", None), ("risk score", None), (" of", None)], "whole before min_tokens: text"


def test_eos_and_stop_token_ids_end_without_text():
    class Chars:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(ord("a") + i) for i in ids if i != EOS)

    tracker = OutputTracker(Chars(), SamplingParams(max_tokens=10, stop_token_ids=[7]), {EOS})
    assert tracker.append(0) == ("a", None)
    assert tracker.append(7) == ("", "stop")
    tracker = OutputTracker(Chars(), SamplingParams(max_tokens=10), {EOS})
    assert tracker.append(2) == ("c", None)
    assert tracker.append(EOS) == ("", "stop")
    with pytest.raises(RuntimeError):
        tracker.append(2)


def test_ignore_eos_and_min_tokens_keep_going():
    class Chars:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(ord("a") + i) for i in ids if i != EOS)

    tracker = OutputTracker(Chars(), SamplingParams(max_tokens=3, ignore_eos=True), {EOS})
    assert tracker.append(EOS) == ("", None)
    assert tracker.append(0) == ("a", None)
    assert tracker.append(EOS) == ("", "length")
    tracker = OutputTracker(Chars(), SamplingParams(max_tokens=9, min_tokens=3, stop=["a"]), {EOS})
    assert tracker.append(EOS) == ("", None)
    assert tracker.append(0) == ("a", None)
    assert tracker.append(0) == ("", "stop")
