"""Load a causal LM and its tokenizer once, with the facts every engine needs about it.

Engines share this so that they agree on what a prompt's tokens are, which tokens end a
generation, and how long a context may be.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, TypeVar

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from engines.base import LONG_PROMPT_CHARS, checked_options
from slogate.config import missing_model_dir, served_model_id

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: Any
    model_id: str
    device: torch.device
    dtype: torch.dtype
    max_context: int
    eos_token_ids: set[int] = field(default_factory=set)

    def encode(self, prompt: str | None, messages: list[dict[str, Any]] | None,
               tools: list[dict[str, Any]] | None = None) -> list[int]:
        return encode_prompt(self.tokenizer, self.model_id, prompt, messages, tools)

    @property
    def vocab_size(self) -> int:
        """The width of the logits, which sampling indexes by token id."""
        return self.model.config.get_text_config().vocab_size


def encode_prompt(tokenizer: Any, model_id: str, prompt: str | None, messages: list[dict[str, Any]] | None,
                  tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Token ids for a completion prompt, or for chat messages (and the tools the model may
    call) through the chat template (ending with the assistant's turn opened, so the model
    answers). A function of the tokenizer alone, so a worker can tokenize while its engine runs
    in another process."""
    if messages is not None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"model {model_id} has no chat template; send a prompt")
        if "developer" not in str(tokenizer.chat_template):  # OpenAI's newer name for the system message
            messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
        if tools and "tools" not in str(tokenizer.chat_template):
            raise ValueError(f"the chat template of model {model_id} does not show tools to the model; "
                             "send no 'tools'")
        return _chat_ids(tokenizer, model_id, messages, tools)
    if prompt is None:
        raise ValueError("a request needs a prompt or messages")
    return _ids(tokenizer, prompt, add_special_tokens=True)


_MARK = re.compile("\ue000(\\d+)\ue001")


def _chat_ids(tokenizer: Any, model_id: str, messages: list[dict[str, Any]],
              tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Only the chat template speaks in special tokens. Tokenizing the rendered template whole
    (what ``apply_chat_template(tokenize=True)`` does) reads a user's ``<|im_start|>system`` as
    the marker itself, so a message could forge turns. A message whose content holds a special
    token's text is rendered as a private-use mark instead, and its content is tokenized apart,
    as plain text. The mark keeps the content's surrounding whitespace, so a template that
    trims or tests content treats it as it would the text. Other messages are rendered as they
    are: a chat with no such text gets exactly transformers' ids. Names, tools and tool calls
    are rendered as they are (as JSON, by most templates), so they may hold no marker at all."""
    def render(msgs: list[dict[str, Any]]) -> str:
        return tokenizer.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False)

    if tools and (tok := _special_in(tokenizer, json.dumps(tools, ensure_ascii=False))):
        raise ValueError(f"tools contains '{tok}', a special token of model {model_id}; remove it")
    for i, m in enumerate(messages):
        for key in ("name", "tool_calls", "tool_call_id"):
            value = m.get(key)
            text = value if isinstance(value, str) or value is None else json.dumps(value, ensure_ascii=False)
            if tok := _special_in(tokenizer, text or ""):
                raise ValueError(f"messages[{i}].{key} contains '{tok}', a special token of model {model_id}; "
                                 "remove it")
    found = {i: tok for i, m in enumerate(messages) if (tok := _special_in(tokenizer, m.get("content") or ""))}
    if not found:
        return _ids(tokenizer, render(messages), add_special_tokens=False)
    marked = [{**m, "content": _mark(m["content"], i)} if i in found else m for i, m in enumerate(messages)]
    pieces = _MARK.split(render(marked))
    placed = [int(p) for p in pieces[1::2]]
    if sorted(placed) != sorted(found):
        i = min(found)
        raise ValueError(f"messages[{i}].content contains '{found[i]}', a special token of model {model_id}, "
                         "and its chat template does not keep message content apart; remove it")
    ids: list[int] = []
    for k, piece in enumerate(pieces):
        if k % 2:
            ids += _plain_ids(tokenizer, messages[int(piece)]["content"].strip())
        elif piece:
            ids += _ids(tokenizer, piece, add_special_tokens=False)
    return ids


def _mark(content: str, i: int) -> str:
    core = content.strip()
    start = content.index(core)
    return f"{content[:start]}\ue000{i}\ue001{content[start + len(core):]}"


def _special_in(tokenizer: Any, content: str) -> str | None:
    """The first special token whose text ``content`` holds. One substring search a token:
    each lets go of the interpreter between calls, where one regular expression over a
    megabyte of ``<|`` held it for a third of a second, stalling the worker's loop."""
    firsts, texts = _special_tokens(tokenizer)
    if not any(ch in content for ch in firsts):
        return None
    return next((tok for tok in texts if tok in content), None)


@lru_cache(maxsize=8)
def _special_tokens(tokenizer: Any) -> tuple[frozenset[str], tuple[str, ...]]:
    texts = sorted((t.content for t in tokenizer.added_tokens_decoder.values() if t.special and t.content),
                   key=len, reverse=True)
    return frozenset(t[0] for t in texts), tuple(texts)


@lru_cache(maxsize=8)
def _plain_backend(tokenizer: Any) -> Any:
    """A copy of the fast tokenizer's encoder that reads special tokens' text as text."""
    from tokenizers import Tokenizer

    plain = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    plain.encode_special_tokens = True
    return plain


def _plain_ids(tokenizer: Any, text: str) -> list[int]:
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True).input_ids)
    return _encode(_plain_backend(tokenizer), text, add_special_tokens=False)


def _ids(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    """A fast tokenizer's Rust encoder. transformers' ``__call__`` hands even one text to the
    tokenizers thread pool: on a worker whose cores are busy, waiting for a pool thread took
    about ten times as long as tokenizing a short prompt, and it stalled the event loop that
    forwards every stream's tokens. So a short text is encoded on this thread. But that call
    holds the GIL throughout (1.6 ms for 2,000 tokens), and long prompts are tokenized on a side
    thread precisely so that the loop and the steps go on: for them the batch call, which
    releases the GIL (another thread's wake-ups were late by 2.3 ms at P99 with one, 0.4 ms
    with the other)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return list(tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
    return _encode(backend, text, add_special_tokens)


def _encode(backend: Any, text: str, add_special_tokens: bool) -> list[int]:
    if len(text) > LONG_PROMPT_CHARS:
        return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
    return backend.encode(text, add_special_tokens=add_special_tokens).ids


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """bf16 on GPUs that compute in it (Ampere on), fp16 on older ones (a T4, a V100: bf16
    there is emulated, several times slower), fp32 on CPUs (where bf16 matmuls are slow or
    emulated)."""
    if dtype == "auto":
        if device.type != "cuda":
            return torch.float32
        with torch.cuda.device(device.index) if device.index is not None else contextlib.nullcontext():
            native = torch.cuda.is_bf16_supported(including_emulation=False)
        return torch.bfloat16 if native else torch.float16
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def load_model(model: str, dtype: str = "auto", device: str = "auto") -> LoadedModel:
    """Load from a local directory, or from a hub id when no such directory exists. A path
    (``/``, ``./``, ``../``) that does not exist is an error naming it, not a hub lookup."""
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    if missing := missing_model_dir(model):
        raise ValueError(missing)
    tokenizer = AutoTokenizer.from_pretrained(model)
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype).to(dev).eval()
    return LoadedModel(
        model=lm,
        tokenizer=tokenizer,
        model_id=served_model_id(model),
        device=dev,
        dtype=torch_dtype,
        max_context=_max_context(lm.config, tokenizer),
        eos_token_ids=_eos_ids(lm, tokenizer),
    )


E = TypeVar("E")
O = TypeVar("O")


def load_engine(name: str, engine: Callable[[LoadedModel, O], E], options_type: type[O], model: str | None,
                dtype: str, device: str, options: dict[str, Any]) -> E:
    """Check ``options`` (:func:`engines.base.checked_options`), then load ``model`` and build
    the engine."""
    if not model:
        raise ValueError(f"the {name} engine needs a model (a local directory or hub id)")
    opts = checked_options(name, options_type, options)
    return engine(load_model(model, dtype=dtype, device=device), opts)


def _max_context(config: Any, tokenizer: Any) -> int:
    """The longest context the engines compute as the model does. Their paged attention
    attends over the whole context, which is what a layer with a sliding window computes only
    while the context fits in its window: beyond it a request gets a 400, not other tokens."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = _sliding_window(text_config)
    for key in _CONTEXT_KEYS:
        value = getattr(text_config, key, None)
        if isinstance(value, int) and value > 0:
            return min(value, window or value)
    limit = getattr(tokenizer, "model_max_length", 0)
    if 0 < limit < 10**9:
        return min(int(limit), window or int(limit))
    raise ValueError("cannot tell the model's context length from its config")


def _sliding_window(config: Any) -> int | None:
    """How many positions back a layer with a sliding window attends, if any layer has one
    (``layer_types`` names them where a model mixes both; Mistral's layers all slide)."""
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or window <= 0:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return window


def _eos_ids(model: PreTrainedModel, tokenizer: Any) -> set[int]:
    """Union of what the tokenizer, config and generation config call end-of-sequence: chat
    models often end a turn with a token that only the generation config names."""
    ids: set[int] = set()
    sources = [tokenizer.eos_token_id, getattr(model.config, "eos_token_id", None)]
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        sources.append(generation_config.eos_token_id)
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids
