"""The paged engine against transformers' own ``generate`` (fp32, greedy, one request at a
time): batching, chunked prefill, preemption and prefix caching must not change a token."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma2Config,
    Gemma2ForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)

from engines.base import EngineRequest, StepOutput
from engines.paged import PagedEngine, create
from engines.paged.fused import FusedLayer
from engines.runtime.packed_linear import PackedLinear
from engines.stream import create as stream_create
from slogate.protocol import SamplingParams

MAX_TOKENS = 24
_WORDS = "the risk score of each card payment must arrive fast while long reports wait".split()


def _text(n_words: int, offset: int = 0) -> str:
    return " ".join(_WORDS[(offset + i * 5) % len(_WORDS)] for i in range(n_words))


PROMPTS = [_text(n, i) for i, n in enumerate([1, 4, 9, 17, 30, 52, 90, 150])]
SHARED_PREFIX = "You are a careful risk analyst. " + _text(120, 3)
PREFIX_PROMPTS = [SHARED_PREFIX + " " + _text(2 + 3 * i, i) for i in range(6)]
MakeEngine = Callable[..., PagedEngine]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path, engine_device: str) -> dict[str, list[int]]:
    """transformers ``generate``, one prompt at a time, never stopping at eos (ignore_eos)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).to(engine_device).eval()
    model.generation_config.eos_token_id = None
    out = {}
    for prompt in PROMPTS + PREFIX_PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids.to(engine_device)
        gen = model.generate(ids, do_sample=False, max_new_tokens=MAX_TOKENS, attention_mask=torch.ones_like(ids))
        out[prompt] = gen[0, ids.shape[1] :].tolist()
    return out


@pytest.fixture
def make_engine(tiny_model_dir: Path, engine_device: str) -> MakeEngine:
    """A small pool unless a test asks otherwise: tests need a few thousand tokens of cache."""

    def build(**options: Any) -> PagedEngine:
        options.setdefault("num_blocks", 256)
        return create(str(tiny_model_dir), dtype="fp32", device=engine_device, **options)

    return build


def _request(rid: str, prompt: str, sampling: SamplingParams = GREEDY, deadline: float | None = None) -> EngineRequest:
    return EngineRequest(rid, sampling, deadline if deadline is not None else time.time() + 3600, prompt=prompt)


def _drain(engine: PagedEngine, max_steps: int = 5000) -> list[StepOutput]:
    outputs: list[StepOutput] = []
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return outputs
        outputs.extend(engine.step())
    raise AssertionError("engine did not finish")


def _tokens(outputs: list[StepOutput]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for out in outputs:
        assert out.error is None, out.error
        tokens.setdefault(out.request_id, []).extend(out.token_ids)
    return tokens


def _assert_pool_clean(engine: PagedEngine) -> None:
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert engine.load().kv_usage == 0.0


CONFIGS = {
    "batched": {},
    "chunked_prefill": {"max_batched_tokens": 32, "max_num_seqs": 8},
    "preempted": {"block_size": 8, "num_blocks": 28},
    "preempted_without_prefix_cache": {"block_size": 8, "num_blocks": 28, "enable_prefix_caching": False},
    "linear_layers_as_transformers_ships_them": {"pack_weights": False},
}


def test_on_cpu_the_engine_runs_the_fused_layers_the_greedy_tests_check(make_engine: MakeEngine,
                                                                         engine_device: str) -> None:
    fused = [isinstance(layer, FusedLayer) for layer in make_engine().runner.decoder.layers]
    assert all(fused) if engine_device == "cpu" else not any(fused)


@pytest.mark.parametrize("config", CONFIGS, ids=list(CONFIGS))
def test_batch_matches_generate_token_for_token(make_engine: MakeEngine, reference: dict, config: str) -> None:
    engine = make_engine(**CONFIGS[config])
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(_request(str(i), prompt))
    outputs = _drain(engine)
    got = _tokens(outputs)
    for i, prompt in enumerate(PROMPTS):
        assert got[str(i)] == reference[prompt], f"prompt {i} diverged"
    finals = [o for o in outputs if o.finish_reason]
    assert sorted(o.request_id for o in finals) == sorted(map(str, range(len(PROMPTS))))
    assert all(o.finish_reason == "length" and o.completion_tokens == MAX_TOKENS for o in finals)
    if config.startswith("preempted"):
        assert engine.scheduler.num_preemptions > 0
    _assert_pool_clean(engine)


def test_prefill_chunks_of_one_token_match_generate(make_engine: MakeEngine, reference: dict) -> None:
    """A budget of four tokens for four sequences leaves a prefill single-token chunks beside
    three decodes: the runner must treat those as queries over a context, not as decodes."""
    engine = make_engine(max_batched_tokens=4, max_num_seqs=4)
    schedule, one_token_chunks = engine.scheduler.schedule, []

    def counting_schedule():
        sched = schedule()
        one_token_chunks.extend(
            s for s, n in zip(sched.seqs, sched.num_new_tokens) if n == 1 and s.num_computed_tokens + 1 < len(s)
        )
        return sched

    engine.scheduler.schedule = counting_schedule
    prompts = PROMPTS[:5]
    for i, prompt in enumerate(prompts):
        engine.add_request(_request(str(i), prompt))
    got = _tokens(_drain(engine))
    for i, prompt in enumerate(prompts):
        assert got[str(i)] == reference[prompt], f"prompt {i} diverged"
    assert one_token_chunks
    _assert_pool_clean(engine)


def test_streamed_text_is_the_decoded_output(make_engine: MakeEngine, reference: dict) -> None:
    engine = make_engine()
    engine.add_request(_request("a", PROMPTS[3]))
    outputs = _drain(engine)
    text = "".join(o.text for o in outputs)
    assert text == engine.loaded.tokenizer.decode(reference[PROMPTS[3]], skip_special_tokens=True)


def test_prefix_cache_hits_do_not_change_outputs(make_engine: MakeEngine, reference: dict) -> None:
    engine = make_engine()
    engine.add_request(_request("p0", PREFIX_PROMPTS[0]))
    outputs = engine.step()
    for i, prompt in enumerate(PREFIX_PROMPTS[1:], start=1):
        engine.add_request(_request(f"p{i}", prompt))
    outputs += _drain(engine)
    got = _tokens(outputs)
    for i, prompt in enumerate(PREFIX_PROMPTS):
        assert got[f"p{i}"] == reference[prompt], f"prompt {i} diverged"
    assert engine.load().extra["prefix_cache_hit_rate"] > 0.5
    _assert_pool_clean(engine)


def test_prefix_cache_with_preemption_and_chunking(make_engine: MakeEngine, reference: dict) -> None:
    engine = make_engine(block_size=8, num_blocks=48, max_batched_tokens=48, max_num_seqs=6)
    for i, prompt in enumerate(PREFIX_PROMPTS):
        engine.add_request(_request(f"p{i}", prompt))
    got = _tokens(_drain(engine))
    for i, prompt in enumerate(PREFIX_PROMPTS):
        assert got[f"p{i}"] == reference[prompt], f"prompt {i} diverged"
    assert engine.block_manager.hit_tokens > 0
    _assert_pool_clean(engine)


def test_blocks_all_return_after_finish_abort_and_preemption(make_engine: MakeEngine) -> None:
    engine = make_engine(block_size=8, num_blocks=28)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(_request(str(i), prompt))
    outputs: list[StepOutput] = []
    for _ in range(6):
        outputs += engine.step()
    running = engine.scheduler.running[0].request_id
    waiting = engine.scheduler.waiting[0].request_id if engine.scheduler.waiting else "7"
    free_before = engine.block_manager.num_free_blocks
    engine.abort_request(running)
    assert engine.block_manager.num_free_blocks > free_before, "abort must free blocks at once"
    engine.abort_request(waiting)
    engine.abort_request("no-such-request")
    after = _drain(engine)
    assert not {running, waiting} & {o.request_id for o in after}
    finished = {o.request_id for o in outputs + after if o.finish_reason}
    assert finished == set(map(str, range(len(PROMPTS)))) - {running, waiting}
    assert engine.scheduler.num_preemptions > 0
    _assert_pool_clean(engine)


def test_expired_deadline_finishes_and_frees_blocks(make_engine: MakeEngine) -> None:
    engine = make_engine()
    now = time.time()
    engine.clock = lambda: now
    engine.add_request(_request("late", PROMPTS[5], deadline=now + 10))
    engine.add_request(_request("past", PROMPTS[2], deadline=now - 1))
    first = engine.step()
    assert [(o.request_id, o.finish_reason) for o in first if o.finish_reason] == [("past", "deadline")]
    engine.step()
    assert engine.load().kv_usage > 0
    engine.clock = lambda: now + 11
    outputs = engine.step()
    assert [(o.request_id, o.finish_reason, o.completion_tokens) for o in outputs] == [("late", "deadline", 2)]
    assert not engine.has_unfinished()
    _assert_pool_clean(engine)


def test_requests_that_can_never_fit_get_a_400(make_engine: MakeEngine) -> None:
    engine = make_engine(num_blocks=8)
    engine.add_request(_request("ctx", PROMPTS[0], SamplingParams(max_tokens=engine.max_context + 1)))
    engine.add_request(_request("pool", PROMPTS[0], SamplingParams(max_tokens=200)))
    engine.add_request(_request("ok", PROMPTS[0], SamplingParams(max_tokens=4, temperature=0.0)))
    outputs = _drain(engine)
    errors = {o.request_id: o for o in outputs if o.error}
    assert set(errors) == {"ctx", "pool"}
    assert all(o.error_status == 400 and o.finish_reason == "error" for o in errors.values())
    assert "context" in errors["ctx"].error and "KV blocks" in errors["pool"].error
    assert any(o.request_id == "ok" and o.finish_reason for o in outputs)


def test_a_default_max_tokens_is_lowered_to_the_room_the_prompt_leaves(make_engine: MakeEngine) -> None:
    engine = make_engine()
    room = 3
    prompt_ids = [(7 * i) % 500 + 10 for i in range(engine.max_context - room)]
    sampling = SamplingParams(max_tokens=16, max_tokens_default=True, temperature=0.0, ignore_eos=True)
    engine.add_request(EngineRequest("fit", sampling, time.time() + 3600, prompt="", prompt_ids=prompt_ids))
    (last,) = [o for o in _drain(engine) if o.finish_reason]
    assert not last.error and (last.finish_reason, last.completion_tokens) == ("length", room)


def test_a_default_max_tokens_is_lowered_to_the_room_the_kv_pool_leaves(make_engine: MakeEngine) -> None:
    """A pool smaller than the context (a large model's, in a small KV budget) holds fewer
    tokens than the context allows: a prompt that fit the pool was refused for a default
    max_tokens the client never asked for ("prompt plus max_tokens needs 5 KV blocks")."""
    engine = make_engine(num_blocks=4)
    pool_tokens = 4 * engine.block_manager.block_size
    assert pool_tokens < engine.max_context
    room = 3
    prompt_ids = [(7 * i) % 500 + 10 for i in range(pool_tokens - room)]
    sampling = SamplingParams(max_tokens=16, max_tokens_default=True, temperature=0.0, ignore_eos=True)
    engine.add_request(EngineRequest("fit", sampling, time.time() + 3600, prompt="", prompt_ids=prompt_ids))
    (last,) = [o for o in _drain(engine) if o.finish_reason or o.error]
    assert not last.error and (last.finish_reason, last.completion_tokens) == ("length", room), last.error


def test_a_stop_token_beyond_the_vocabulary_fails_only_its_own_request(make_engine: MakeEngine) -> None:
    """Sampling bans stop tokens by id until min_tokens: an id past the logits failed the step,
    and with it every request the engine held."""
    engine = make_engine()
    vocab = engine.loaded.vocab_size
    bad = SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=[3, vocab])
    engine.add_request(_request("bad", PROMPTS[0], bad))
    engine.add_request(_request("biased", PROMPTS[0], SamplingParams(max_tokens=8, logit_bias={vocab + 1: 5.0})))
    engine.add_request(_request("ok", PROMPTS[1], SamplingParams(max_tokens=4, temperature=0.0, min_tokens=2,
                                                                  stop_token_ids=[vocab - 1])))
    outputs = _drain(engine)
    errors = {o.request_id: o for o in outputs if o.error}
    assert errors.keys() == {"bad", "biased"} and all(e.error_status == 400 for e in errors.values())
    assert f"'stop_token_ids' holds {vocab}" in errors["bad"].error
    assert f"'logit_bias' holds {vocab + 1}" in errors["biased"].error
    assert any(o.request_id == "ok" and o.finish_reason == "length" for o in outputs)
    _assert_pool_clean(engine)


def test_the_engine_does_not_grow_the_requests_prompt(make_engine: MakeEngine) -> None:
    engine = make_engine()
    prepared = engine.prepare(_request("p", PROMPTS[1], SamplingParams(max_tokens=4, temperature=0.0)))
    prompt = list(prepared.prompt_ids)
    engine.add_request(prepared)
    _drain(engine)
    assert prepared.prompt_ids == prompt, "a redelivered request would be prompted with its own output"


def test_load_reports_queue_and_cache(make_engine: MakeEngine) -> None:
    engine = make_engine(max_num_seqs=2)
    for i, prompt in enumerate(PROMPTS[:4]):
        engine.add_request(_request(str(i), prompt))
    engine.step()
    engine.step()
    load = engine.load()
    assert (load.running, load.waiting, load.capacity) == (2, 2, 2)
    assert 0 < load.kv_usage < 1
    assert load.decode_step_s > 0 and load.prefill_s_per_token > 0
    assert {"prefix_cache_hit_rate", "kv_blocks_total", "kv_blocks_free"} <= set(load.extra)


def test_seeded_sampling_is_reproducible_in_a_batch(make_engine: MakeEngine) -> None:
    seeded = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    runs = []
    for companions in (0, 3):
        engine = make_engine()
        engine.add_request(_request("s", PROMPTS[4], seeded))
        for i in range(companions):
            engine.add_request(_request(f"c{i}", PROMPTS[i], SamplingParams(max_tokens=12, temperature=1.0)))
        runs.append(_tokens(_drain(engine))["s"])
    assert runs[0] == runs[1]


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("engine", ["paged", "stream"])
def test_weights_are_packed_unless_asked_not_to(tiny_model_dir: Path, engine: str) -> None:
    make = create if engine == "paged" else stream_create
    for pack in (True, False):
        built = make(str(tiny_model_dir), dtype="fp32", device="cpu", num_blocks=64, pack_weights=pack)
        kinds = {type(m) for m in built.loaded.model.modules()}
        assert (PackedLinear in kinds) is pack and (torch.nn.Linear in kinds) is not pack


@pytest.mark.parametrize("engine", ["paged", "stream"])
def test_bf16_engines_run_on_any_cpu(tiny_model_dir: Path, engine: str) -> None:
    """bf16 on a CPU whose oneDNN has no bf16 kernels (AVX2 only) leaves the weights unpacked
    instead of failing to start."""
    make = create if engine == "paged" else partial(stream_create, warmup=False)
    built = make(str(tiny_model_dir), dtype="bf16", device="cpu", num_blocks=64)
    assert built.loaded.dtype == torch.bfloat16
    built.add_request(_request("a", PROMPTS[3], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)))
    outputs = _drain(built)
    assert sum(len(o.token_ids) for o in outputs) == 4 and outputs[-1].finish_reason == "length"


def test_create_names_unknown_options(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="block_sise"):
        create(str(tiny_model_dir), block_sise=16)
    with pytest.raises(ValueError, match="max_num_seqs"):
        create(str(tiny_model_dir), max_num_seqs=0)


def test_a_redelivered_request_is_served_once(make_engine: MakeEngine, reference: dict) -> None:
    engine = make_engine()
    engine.add_request(_request("a", PROMPTS[2]))
    outputs = engine.step()
    engine.add_request(_request("a", PROMPTS[2]))
    outputs += _drain(engine)
    assert _tokens(outputs)["a"] == reference[PROMPTS[2]]
    assert sum(1 for o in outputs if o.finish_reason) == 1
    _assert_pool_clean(engine)


def test_prepared_requests_are_served_as_unprepared_ones(make_engine: MakeEngine, reference: dict) -> None:
    """The worker tokenizes on another thread through ``prepare``; the tokens it computes
    ahead must be the ones ``add_request`` would, and a request ``prepare`` cannot tokenize
    still gets its error from ``add_request``."""
    engine = make_engine()
    prepared = engine.prepare(_request("p", PROMPTS[1]))
    assert prepared.prompt_ids == engine.loaded.encode(PROMPTS[1], None)
    chat = EngineRequest("chat", GREEDY, time.time() + 3600, messages=[{"role": "user", "content": "hi"}])
    assert engine.prepare(chat).prompt_ids == engine.loaded.encode(None, chat.messages)
    broken = EngineRequest("broken", GREEDY, time.time() + 3600)
    assert engine.prepare(broken) is broken
    engine.add_request(prepared)
    engine.add_request(engine.prepare(broken))
    outputs = _drain(engine)
    assert _tokens([o for o in outputs if o.request_id == "p"])["p"] == reference[PROMPTS[1]]
    error = next(o for o in outputs if o.request_id == "broken")
    assert error.error_status == 400 and "cannot tokenize" in error.error


@pytest.mark.parametrize("which", ["paged", "stream"])
def test_logprobs_are_the_models_own_as_generate_gives_them(tiny_model_dir: Path, engine_device: str,
                                                           which: str) -> None:
    """Sampled with temperature and penalties, the log-probabilities are still the raw model's:
    transformers' logits for the same tokens (teacher-forced), log-softmaxed."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).to(engine_device).eval()
    build = create if which == "paged" else stream_create
    engine = build(str(tiny_model_dir), dtype="fp32", device=engine_device, num_blocks=256)
    sampling = {
        "greedy": SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3),
        "sampled": SamplingParams(max_tokens=12, temperature=1.3, seed=7, presence_penalty=1.0,
                                  ignore_eos=True, logprobs=0),
        "none": SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
    }
    prompt = PROMPTS[3]
    for rid, params in sampling.items():
        engine.add_request(_request(rid, prompt, params))
    outputs = _drain(engine)
    tokens = _tokens(outputs)
    by_request: dict[str, list] = {}
    for out in outputs:
        by_request.setdefault(out.request_id, []).extend(out.logprobs)
    assert by_request["none"] == []
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(engine_device)
    for rid in ("greedy", "sampled"):
        entries = by_request[rid]
        assert len(entries) == len(tokens[rid]) == 12, "one for each token sampled"
        full = torch.cat([ids, torch.tensor([tokens[rid]], device=engine_device)], dim=1)
        with torch.no_grad():
            expected = torch.log_softmax(model(full).logits[0, ids.shape[1] - 1 : -1].float(), dim=-1)
        for step, (entry, token) in enumerate(zip(entries, tokens[rid])):
            assert entry.logprob == pytest.approx(expected[step, token].item(), abs=1e-4)
            assert entry.raw == tokenizer.convert_tokens_to_string([tokenizer.convert_ids_to_tokens(token)]).encode() \
                or "\ufffd" in entry.token
            if rid == "greedy":
                best = expected[step].topk(3)
                assert [t[0] for t in entry.top] == [entry.token] + [tokenizer.decode([i]) for i in best.indices[1:]]
                assert [t[2] for t in entry.top] == pytest.approx(best.values.tolist(), abs=1e-4)
                assert entry.top[0][2] == entry.logprob
            else:
                assert entry.top == []
    assert "".join(e.token for e in by_request["greedy"]) == tokenizer.decode(tokens["greedy"])


def _sliding_window_model(tiny_model_dir: Path, out: Path, window: int) -> Path:
    """The tiny model's tokenizer on a Mistral whose layers attend over the last ``window``
    positions only."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = MistralConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                           sliding_window=window, initializer_range=0.25, tie_word_embeddings=False,
                           bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        MistralForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_a_sliding_window_model_serves_only_contexts_its_window_holds(tiny_model_dir: Path, tmp_path: Path,
                                                                     engine_device: str) -> None:
    """Paged attention attends over the whole context: a model whose layers slide over the last
    16 positions was served 34-token contexts with other tokens than its own. Within the window
    both agree; beyond it the request is a 400."""
    model_dir = _sliding_window_model(tiny_model_dir, tmp_path / "swa", window=16)
    engine = create(str(model_dir), dtype="fp32", device=engine_device, num_blocks=64)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(engine_device).eval()
    ids = engine.loaded.encode(PROMPTS[3], None)[:10]
    prompt = torch.tensor([ids], device=engine_device)
    expected = model.generate(prompt, do_sample=False, max_new_tokens=6, eos_token_id=None,
                              attention_mask=torch.ones_like(prompt))[0, len(ids):].tolist()
    fits = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    beyond = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine.add_request(EngineRequest("fits", fits, time.time() + 3600, prompt_ids=ids))
    engine.add_request(EngineRequest("beyond", beyond, time.time() + 3600,
                                     prompt_ids=engine.loaded.encode(PROMPTS[4], None)[:22]))
    outputs = _drain(engine)
    assert _tokens([o for o in outputs if o.request_id == "fits"])["fits"] == expected
    error = next(o for o in outputs if o.request_id == "beyond")
    assert (error.error_status, error.error_code) == (400, "context_length_exceeded"), error
    assert engine.max_context == 16
    _assert_pool_clean(engine)


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_a_model_whose_attention_caps_its_scores_is_refused(tiny_model_dir: Path, tmp_path: Path,
                                                           engine_device: str, softcap: float | None) -> None:
    """Paged attention has no soft-capping of attention scores (Gemma 2's tanh): with it the
    engine served log-probabilities 0.003 off transformers' (-1.3347 for -1.3378), greedy
    tokens drifting with them. Such a model is refused at start; the same model without it runs."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = Gemma2Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                          head_dim=32, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                          sliding_window=512, attn_logit_softcapping=softcap, bos_token_id=tokenizer.bos_token_id,
                          eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    Gemma2ForCausalLM(config).save_pretrained(tmp_path / "gemma2")
    tokenizer.save_pretrained(tmp_path / "gemma2")
    if softcap is None:
        assert create(str(tmp_path / "gemma2"), dtype="fp32", device=engine_device, num_blocks=8)
        return
    with pytest.raises(ValueError, match="soft-cap"):
        create(str(tmp_path / "gemma2"), dtype="fp32", device=engine_device, num_blocks=8)
