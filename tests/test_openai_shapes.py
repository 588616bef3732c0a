"""Completions' log-probabilities where tokens split a character: OpenAI's legacy shape has no
bytes, so such tokens are named by theirs and placed where their character starts."""

from __future__ import annotations

import random

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


def char_starts(data: bytes) -> list[int]:
    """For each byte, the index of the character it is part of, as UTF-8 decoding with U+FFFD
    for each maximal ill-formed part reads them (what Python's "replace" does)."""
    owner, chars, p = [], 0, 0
    while p < len(data):
        width = 1
        for k in range(1, min(4, len(data) - p) + 1):
            try:
                data[p:p + k].decode("utf-8")
                width = k
                break
            except UnicodeDecodeError as exc:
                if exc.reason != "unexpected end of data":
                    break
                width = k  # a well-formed start so far: one U+FFFD for all of it if it never ends
        owner += [chars] * width
        chars += 1
        p += width
    return owner


def test_offsets_agree_with_decoding_the_whole_text_whatever_the_bytes() -> None:
    pieces = [b"a", b"\xe0", b"\x98", b"\xa3", b"\xe9", b"\xed", b"\xa0", b"\xf0", b"\x9f", b"\x8e", b"\xf4",
              b"\x90", b"\xc0", b"\xc3", b"\xa9", b"\xf5", b"\xbf", "风".encode(), "风".encode()[:2],
              "🙂".encode()[:1], "🙂".encode()[1:], "🙂".encode()[2:], b"ok"]
    rng = random.Random(0)
    for _ in range(20000):
        tokens = [rng.choice(pieces) for _ in range(rng.randint(1, 8))]
        owner = char_starts(b"".join(tokens))
        expected, at = [], 0
        for raw in tokens:
            expected.append(owner[at])
            at += len(raw)
        entries = [TokenLogprob("", raw, -1.0) for raw in tokens]
        assert completion_logprobs(entries)["text_offset"] == expected, tokens


def test_alternatives_sharing_a_name_keep_the_sampled_or_the_likelier_figure() -> None:
    entry = TokenLogprob(" a", b" a", -2.0, [(" b", b" b", -0.5), (" a", b" a", -1.0), (" b", b" b", -3.0)])
    assert completion_logprobs([entry])["top_logprobs"] == [{" a": -2.0, " b": -0.5}]
