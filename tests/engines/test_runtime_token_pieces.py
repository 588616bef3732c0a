"""Each token's bytes put back together exactly what the text was, characters split or not."""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from engines.runtime.detokenizer import OutputTracker
from engines.runtime.token_pieces import TokenPieces
from slogate.protocol import SamplingParams

TEXT = "risk 风险 score 🙂 ok"


def test_byte_level_tokens_give_their_bytes_even_inside_a_character(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    pieces = TokenPieces(tokenizer)
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    got = [pieces(i) for i in ids]
    assert b"".join(raw for _, raw in got) == TEXT.encode()
    assert any(text == "\ufffd" or "\ufffd" in text for text, _ in got), "the emoji is split into bytes"
    assert all(text == raw.decode() for text, raw in got if "\ufffd" not in text)
    eos = tokenizer.eos_token_id
    assert pieces(eos) == (tokenizer.eos_token, b""), "named, but no part of the text"
    assert pieces(len(tokenizer) + 5) == ("", b""), "a padded logit beyond the vocabulary"


def _llama2_style() -> PreTrainedTokenizerFast:
    """SentencePiece BPE with byte fallback, and Llama 2's decoder, which strips the text's first space."""
    words = ["\u2581", "r", "i", "s", "k", "o", "\u2581r", "\u2581ri", "\u2581ris", "\u2581risk", "\u2581o", "\u2581ok"]
    vocab = {"<unk>": 0, "<s>": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)},
             **{w: 258 + i for i, w in enumerate(words)}}
    merges = [("\u2581", "r"), ("\u2581r", "i"), ("\u2581ri", "s"), ("\u2581ris", "k"),
              ("\u2581", "o"), ("\u2581o", "k")]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>")


def test_sentencepiece_byte_fallback_tokens_give_their_byte() -> None:
    tokenizer = _llama2_style()
    pieces = TokenPieces(tokenizer)
    ids = tokenizer("risk 风 ok", add_special_tokens=False).input_ids
    got = [pieces(i) for i in ids]
    assert got[0] == (" risk", b" risk")
    assert [raw for _, raw in got[2:5]] == [bytes([b]) for b in "风".encode()], "one token a byte"
    assert b"".join(raw for _, raw in got) == " risk 风 ok".encode()


def test_tokens_only_flagged_special_add_no_bytes_and_other_added_tokens_what_decoding_gives(
        tiny_model_dir: Path) -> None:
    """As Llama 3's reserved tokens: special in the tokenizer, not one of its named tokens."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_tokens([AddedToken("<|reserved_0|>", special=True), AddedToken("<risk>", special=False),
                          AddedToken("<risk-é>", special=False)])
    reserved, plain, accented = tokenizer.convert_tokens_to_ids(["<|reserved_0|>", "<risk>", "<risk-é>"])
    assert reserved not in tokenizer.all_special_ids
    pieces = TokenPieces(tokenizer)
    assert pieces(reserved) == ("<|reserved_0|>", b"")
    assert pieces(plain) == ("<risk>", b"<risk>")
    ids = tokenizer("hi", add_special_tokens=False).input_ids + [reserved, plain, accented]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    assert b"".join(pieces(i)[1] for i in ids).decode("utf-8", "replace") == text


def test_metaspace_tokens_without_byte_fallback_keep_their_space() -> None:
    """A SentencePiece (Metaspace) tokenizer without byte fallback: the tokens' bytes must
    still add up to the text, spaces included."""
    vocab = [("<unk>", 0.0), ("\u2581risk", -1.0), ("\u2581ok", -1.0), ("\u2581", -2.0),
             *((c, -3.0) for c in "risko")]
    backend = Tokenizer(models.Unigram(vocab, unk_id=0))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    ids = tokenizer("risk ok risk", add_special_tokens=False).input_ids
    pieces = TokenPieces(tokenizer)
    # the text after the first token, as the detokenizer streams it (with context before it)
    assert b"".join(pieces(i)[1] for i in ids[1:]) == b" ok risk"


def test_first_token_of_a_text_loses_the_space_its_tokenizer_drops_there() -> None:
    """After an empty prompt, Llama 2's decoder strips the completion's first space: the first
    token's bytes (and its alternatives') must drop it too, and only at the start."""
    tokenizer = _llama2_style()
    pieces = TokenPieces(tokenizer)
    ids = tokenizer("risk ok", add_special_tokens=False).input_ids
    for prompt, text in (([tokenizer.bos_token_id], "risk ok"), (tokenizer("ok").input_ids, " risk ok")):
        tracker = OutputTracker(tokenizer, SamplingParams(max_tokens=len(ids)), {0}, prompt_ids=prompt)
        shown = b""
        for i in ids:
            shown += pieces(i, tracker.at_start)[1]
            tracker.append(i)
        assert tracker.text == text
        assert shown == text.encode()
    assert pieces(ids[1], at_start=True) == ("ok", b"ok")
