"""Each token's own text and exact bytes, as log-probabilities show them.

Decoding one token alone gives its text, but a byte-level token inside a character (Chinese,
emoji) decodes to U+FFFD, and the client cannot put the character back together from that.
OpenAI's answer is each token's bytes. Byte-level BPE (GPT-2, Llama 3, Qwen) spells a token's
bytes as printable characters, one for each, and SentencePiece with byte fallback (Llama 2,
Mistral) has a token ``<0xHH>`` for each byte: both are mapped back to the bytes exactly.
SentencePiece's other tokens are their names with its space mark made a space, except at the
very start of a text, where its decoders drop that space (and so must the bytes). For other
tokenizers the bytes are the decoded text's. A special token keeps its name as its text but
has no bytes: the completion's text leaves it out, and the bytes must add up to that text.
"""

from __future__ import annotations

import re
from typing import Any

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_CACHED = 1 << 16
"""Tokens whose pieces are kept (a vocabulary's common ones; each costs a decode to find)."""


def _byte_level_table() -> dict[str, int]:
    """The character byte-level BPE writes for each byte (GPT-2's table), reversed."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


class TokenPieces:
    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        kind = repr(decoder)
        self._byte_level = _byte_level_table() if "ByteLevel" in kind else None
        self._byte_fallback = "ByteFallback" in kind
        self._metaspace = self._byte_fallback or "Metaspace" in kind
        """SentencePiece spells a space "\u2581"; decoded alone, a token loses its leading one."""
        self._drops_first_space = self._metaspace and _drops_first_space(tokenizer)
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self._special = {i for i, t in added.items() if t.special} | set(getattr(tokenizer, "all_special_ids", ()))
        """What decoding the text leaves out: the named special tokens and those only flagged
        special (Llama 3's reserved tokens)."""
        self._cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int, at_start: bool = False) -> tuple[str, bytes]:
        """The token's text (U+FFFD where it holds part of a character) and the bytes it adds
        to the completion's text; ``at_start`` when nothing before it has decoded to text (an
        empty prompt), where the tokenizer may drop its leading space."""
        found = self._cache.get(token_id)
        if found is None:
            found = self._piece(token_id)
            if len(self._cache) < _CACHED:
                self._cache[token_id] = found
        if at_start and self._drops_first_space and found[0].startswith(" "):
            return found[0][1:], found[1][1:]
        return found

    def _piece(self, token_id: int) -> tuple[str, bytes]:
        name = self._tokenizer.convert_ids_to_tokens(token_id)
        if name is None:  # beyond the tokenizer's vocabulary (a model may pad its logits)
            return "", b""
        if token_id in self._special:
            return name, b""
        if self._byte_level is not None and all(c in self._byte_level for c in name):
            raw = bytes(self._byte_level[c] for c in name)
            return raw.decode("utf-8", "replace"), raw
        if self._byte_fallback and (m := _BYTE_TOKEN.fullmatch(name)):
            raw = bytes([int(m.group(1), 16)])
            return raw.decode("utf-8", "replace"), raw
        text = name.replace("\u2581", " ") if self._metaspace else self._tokenizer.decode([token_id])
        return text, text.encode()


def _drops_first_space(tokenizer: Any) -> bool:
    """Whether decoding drops the space a text's first token starts with (Llama 2's decoder
    strips it, as does Metaspace's with a prepended space); tried on one such token."""
    vocab = tokenizer.get_vocab()
    marked = next((i for name, i in vocab.items() if len(name) > 1 and name.startswith("\u2581")), None)
    return marked is not None and not tokenizer.decode([marked]).startswith(" ")
