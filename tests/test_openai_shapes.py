"""Completions' log-probabilities where tokens split a character: OpenAI's legacy shape has no
bytes, so such tokens are named by theirs and placed where their character starts."""

from __future__ import annotations

from gateway.openai_shapes import ChunkWriter, completion_logprobs
from slogate.protocol import TokenLogprob

FENG = "风".encode()  # three bytes


def split_feng_then_x() -> list[TokenLogprob]:
    return [TokenLogprob("\ufffd", FENG[:2], -1.0, [("\ufffd", FENG[:2], -1.0), ("\ufffd", b"\xe9\xa4", -2.0)]),
            TokenLogprob("\ufffd", FENG[2:], -0.5),
            TokenLogprob("x", b"x", -0.1, [("x", b"x", -0.1), ("y", b"y", -3.0)])]


def test_tokens_inside_a_character_are_named_by_their_bytes_and_keep_their_alternatives_apart() -> None:
    shown = completion_logprobs(split_feng_then_x())
    assert shown["tokens"] == ["bytes:\\xe9\\xa3", "bytes:\\x8e", "x"]
    assert shown["top_logprobs"][0] == {"bytes:\\xe9\\xa3": -1.0, "bytes:\\xe9\\xa4": -2.0}
    assert shown["top_logprobs"][2] == {"x": -0.1, "y": -3.0}
    assert shown["text_offset"] == [0, 0, 1], "x is the second character of the text"


def test_a_streams_offsets_run_on_across_its_chunks() -> None:
    writer = ChunkWriter("completion", "cmpl-1", 0, "m")
    entries = split_feng_then_x()
    first, second = writer.text("", None, entries[:1]), writer.text("风x", None, entries[1:])
    assert b'"text_offset":[0]' in first and b'"text_offset":[0,1]' in second


def test_a_character_left_unfinished_is_one_before_the_next_token_and_a_special_token_is_none() -> None:
    entries = [TokenLogprob("\ufffd", FENG[:1], -1.0), TokenLogprob("a", b"a", -1.0),
               TokenLogprob("<|im_end|>", b"", -1.0), TokenLogprob("b", b"b", -1.0)]
    shown = completion_logprobs(entries)
    assert shown["text_offset"] == [0, 1, 2, 2], "the text is U+FFFD, a, b"
    assert shown["tokens"] == ["bytes:\\xe9", "a", "<|im_end|>", "b"]
