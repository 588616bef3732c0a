"""Build a small Llama model with its own tokenizer, offline, so tests and benchmarks never
need a model hub.

The weights are random but seeded, so every build of a size is identical. The tokenizer is a
byte-level BPE trained on a built-in corpus that is mostly English: Chinese and emoji appear
rarely enough that most of their characters stay split across several byte tokens, which is
what makes incremental detokenization worth testing.
"""

from __future__ import annotations

import random
import stat
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

BOS, EOS, PAD, IM_START, IM_END = "<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, IM_START, IM_END]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and tools and loop.first %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n<tool_response>\\n' }}{{ message['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{% if message['content'] or not loop.first %}{{ '\\n' }}{% endif %}"
    "<tool_call>\n{\"name\": {{ call['function']['name'] | tojson }}, "
    "\"arguments\": {{ call['function']['arguments'] | tojson }}}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML, with tools as Qwen2.5 and Hermes lay them out: the functions listed in the system
turn, each call the model made as a ``<tool_call>`` block of JSON, and the results in the next
user turn as ``<tool_response>`` blocks. Without tools it renders as plain ChatML did."""

_PARAGRAPHS = [
    "The gateway accepts requests that look exactly like the OpenAI API and streams the answer "
    "back as server-sent events. Each request carries a deadline; work that cannot finish in "
    "time is shed early with a clear error instead of timing out late.",
    "A risk service scores thousands of card transactions a second. Every score must arrive "
    "within 150 ms at the 99th percentile, while long report jobs share the same machines and "
    "only care about throughput.",
    "Workers read from Redis Streams with consumer groups. A worker that dies leaves its entry "
    "pending, and another worker claims it after a timeout, so no request is lost.",
    "def score(transaction):\n    amount = transaction['amount']\n    if amount > 10000:\n"
    "        return 0.9\n    return 0.1\n",
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.",
    "Prefill turns the prompt into a key-value cache; decode then adds one token per step. "
    "Chunked prefill keeps running streams moving while a long prompt is read.",
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. January, February, March, "
    "April, May, June, July, August, September, October, November, December.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 256 1024 2048 3.14 2.718 -7 +15% $1,250.00",
    "Hello! How are you today? I am fine, thank you. What would you like to know about latency, "
    "throughput, goodput, queues, batches, tokens and deadlines?",
]
_RARE = ["你好，世界。", "风险评分必须在一百五十毫秒内完成。", "谢谢", "🙂", "🚀 launch", "👍🏽", "naïve café"]
_WORDS = (
    "the a an of to in on for with by from at as is are was be been request token stream "
    "model engine batch queue deadline latency score risk card payment user server client "
    "answer report fast slow high low first last next each every many few more less"
).split()


_VOCAB = 2048
"""The BPE target; the built-in corpus yields a little under it."""


@dataclass(frozen=True)
class _Size:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int


_SIZES = {
    "tiny": _Size(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=384),
    "100m": _Size(hidden=768, layers=13, heads=12, kv_heads=4, intermediate=2560),
}


def _corpus(seed: int) -> list[str]:
    """Built-in text plus seeded word salad: enough pairs for a few thousand BPE merges."""
    rng = random.Random(seed)
    lines = _PARAGRAPHS * 20 + _RARE
    for _ in range(3000):
        words = rng.choices(_WORDS, k=rng.randint(4, 12))
        ending = rng.choice([".", "?", "!", ",", ""])
        lines.append(" ".join(words) + ending + f" {rng.randint(0, 99999)}")
    return lines


def _train_tokenizer(vocab_size: int, seed: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
    )


def build_tiny_model(out_dir: str | Path, size: str = "tiny", seed: int = 0) -> Path:
    """Write a loadable model directory (safetensors + tokenizer + chat template).

    Weights use a larger init than Llama's default so that a random model's logits are
    peaked enough for greedy decoding to wander over the vocabulary instead of repeating one
    token.
    """
    if size not in _SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {sorted(_SIZES)}")
    spec = _SIZES[size]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(_VOCAB, seed)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=2048,
        initializer_range=0.25 if size == "tiny" else 0.05,
        tie_word_embeddings=False,
        bos_token_id=ids[BOS],
        eos_token_id=[ids[EOS], ids[IM_END]],
        pad_token_id=ids[PAD],
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=ids[BOS], eos_token_id=[ids[EOS], ids[IM_END]], pad_token_id=ids[PAD]
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _readable_as_config(out)
    return out


def _readable_as_config(out: Path) -> None:
    """safetensors (0.8 on) writes through a temporary file created 0600, whatever the umask:
    a model built by one user (compose's ``model`` service, as root) would be unreadable to
    another (the workers). The weights get the mode the umask gave ``config.json``."""
    mode = stat.S_IMODE((out / "config.json").stat().st_mode)
    for weights in out.glob("*.safetensors"):
        weights.chmod(mode)
