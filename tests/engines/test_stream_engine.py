"""The stream engine against transformers' own ``generate`` (fp32, greedy): requests joining
and leaving, chunked prompts and aborts must not change a token, and text streams out whole."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from engines.base import EngineRequest, StepOutput
from engines.runtime.loader import LoadedModel, load_model
from engines.stepping import Failure, Step, step_until_stopped
from engines.stream import StreamEngine, StreamOptions, create
from slogate.protocol import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [
    "The gateway accepts",
    "你好，世界。 🚀 launch",
    "Hello! How are you today? I am fine, thank you. What would you like to know about latency?",
    "0 1 2",
]


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path, engine_device: str) -> LoadedModel:
    """The reference: transformers' own attention, never handed to an engine (an engine
    switches its model to paged attention)."""
    return load_model(str(tiny_model_dir), dtype="fp32", device=engine_device)


@pytest.fixture
def make(tiny_model_dir: Path, engine_device: str):
    def build(**options) -> StreamEngine:
        fresh = load_model(str(tiny_model_dir), dtype="fp32", device=engine_device)
        options.setdefault("warmup", False)
        options.setdefault("num_blocks", 256)
        return StreamEngine(fresh, StreamOptions(**options))

    return build


def request(
    rid: str, prompt: str | None = None, deadline: float = 3600.0, messages=None, tools=None, **params
) -> EngineRequest:
    params.setdefault("temperature", 0.0)
    sampling = SamplingParams(**params)
    return EngineRequest(rid, sampling, time.time() + deadline, prompt=prompt, messages=messages, tools=tools)


def drain(engine: StreamEngine, max_steps: int = 500) -> list[list[StepOutput]]:
    steps = []
    while engine.has_unfinished() and len(steps) < max_steps:
        steps.append(engine.step())
    assert not engine.has_unfinished()
    return steps


def by_request(steps: list[list[StepOutput]]) -> dict[str, list[StepOutput]]:
    out: dict[str, list[StepOutput]] = {}
    for step in steps:
        for o in step:
            out.setdefault(o.request_id, []).append(o)
    return out


def tokens_of(outputs: list[StepOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


def reference(loaded: LoadedModel, prompt_ids: list[int], max_tokens: int, **kwargs) -> list[int]:
    ids = torch.tensor([prompt_ids], device=loaded.device)
    out = loaded.model.generate(ids, max_new_tokens=max_tokens, do_sample=False, **kwargs)
    return out[0, ids.shape[1] :].tolist()


def assert_pool_clean(engine: StreamEngine) -> None:
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and engine.kv_bytes() == 0
    assert engine.load().kv_usage == 0.0


@pytest.mark.parametrize("chunk", [None, 7])
def test_greedy_matches_transformers_generate(make, loaded: LoadedModel, chunk: int | None):
    engine = make(prefill_chunk_tokens=chunk)
    chat = [{"role": "user", "content": "score this 🙂 transaction"}]
    engine.add_request(request("p0", PROMPTS[0], max_tokens=24))
    engine.add_request(request("p1", PROMPTS[1], max_tokens=24))
    steps = [engine.step(), engine.step()]
    for i, prompt in enumerate(PROMPTS[2:], start=2):
        engine.add_request(request(f"p{i}", prompt, max_tokens=24))
    engine.add_request(request("chat", messages=chat, max_tokens=24))
    steps += drain(engine)
    outputs = by_request(steps)
    for i, prompt in enumerate(PROMPTS):
        expected = reference(loaded, loaded.encode(prompt, None), 24)
        assert tokens_of(outputs[f"p{i}"]) == expected, prompt
    assert tokens_of(outputs["chat"]) == reference(loaded, loaded.encode(None, chat), 24)


def test_a_chat_with_tools_is_prompted_with_them(make, loaded: LoadedModel) -> None:
    engine = make()
    chat = [{"role": "user", "content": "weather in Paris?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    engine.add_request(request("tools", messages=chat, tools=tools, max_tokens=8))
    outputs = by_request(drain(engine))["tools"]
    prompt_ids = loaded.encode(None, chat, tools)
    assert outputs[-1].prompt_tokens == len(prompt_ids) > len(loaded.encode(None, chat))
    assert tokens_of(outputs) == reference(loaded, prompt_ids, 8)
    assert_pool_clean(engine)


def test_each_token_is_output_the_step_it_is_sampled(make, loaded: LoadedModel):
    engine = make()
    engine.add_request(request("a", PROMPTS[0], max_tokens=6, ignore_eos=True))
    steps = drain(engine)
    assert [len(s) for s in steps] == [1] * 6
    assert all(len(s[0].token_ids) == 1 for s in steps)
    assert [s[0].completion_tokens for s in steps] == [1, 2, 3, 4, 5, 6]
    assert steps[-1][0].finish_reason == "length"
    assert all(s[0].finish_reason is None for s in steps[:-1])
    assert steps[0][0].prompt_tokens == len(loaded.encode(PROMPTS[0], None))


def test_random_model_deltas_concatenate_to_decoded_text(make, loaded: LoadedModel):
    engine = make()
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(request(f"r{i}", prompt, max_tokens=40, temperature=1.0, seed=i, ignore_eos=True))
    for rid, outputs in by_request(drain(engine)).items():
        text = "".join(o.text for o in outputs)
        assert text == loaded.tokenizer.decode(tokens_of(outputs), skip_special_tokens=True), rid


def scripted(engine: StreamEngine, loaded: LoadedModel, text: str, prompt: str) -> StreamEngine:
    """``engine`` with every step's logits saying ``text``, then eos (the real model still runs,
    and with it the KV path): the token at position p is the script's (p + 1 - prompt
    length)-th. Set on the model runner's output, so passes cut into a paused step get it too."""
    script = loaded.tokenizer(text, add_special_tokens=False).input_ids + [loaded.tokenizer.eos_token_id]
    prompt_len = len(loaded.encode(prompt, None))
    said = torch.tensor(script, device=loaded.device)
    run = engine.runner.run

    def say(sched, pause=None):
        sampled, logits = run(sched, pause)
        positions = torch.tensor([sched.seqs[i].num_computed_tokens + sched.num_new_tokens[i] - 1 for i in sampled],
                                 device=logits.device)
        tokens = said[(positions + 1 - prompt_len).clamp(0, len(script) - 1)]
        return sampled, torch.full_like(logits, -1e9).scatter_(-1, tokens.view(-1, 1), 0.0)

    engine.runner.run = say
    return engine


def test_chinese_and_emoji_stream_as_whole_characters(make, loaded: LoadedModel):
    text = "风险评分 🚀 完成了 👍🏽 naïve café 你好"
    engine = scripted(make(), loaded, text, "q")
    engine.add_request(request("a", "q", max_tokens=200))
    engine.add_request(request("b", "q", max_tokens=200))
    outputs = by_request(drain(engine))
    for rid in ("a", "b"):
        deltas = [o.text for o in outputs[rid]]
        assert "".join(deltas) == text
        assert all("\ufffd" not in d for d in deltas)
        assert deltas.count("") > 5, "byte tokens of one character must be held back"
        assert outputs[rid][-1].finish_reason == "stop"


def test_stop_string_split_across_tokens_is_never_emitted_in_part(make, loaded: LoadedModel):
    text = "risk 风险评估 is high 风险评分 END ignored"
    engine = scripted(make(), loaded, text, "q")
    engine.add_request(request("a", "q", max_tokens=200, stop=["风险评分"]))
    outputs = by_request(drain(engine))["a"]
    streamed = ""
    for o in outputs:
        streamed += o.text
        assert "风险评分" not in streamed
        assert not streamed.endswith(("风", "风险")) or o.finish_reason is not None
    assert streamed == "risk 风险评估 is high "
    assert outputs[-1].finish_reason == "stop"


def test_abort_frees_kv_at_once_and_survivors_are_unaffected(make, loaded: LoadedModel):
    engine = make()
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(request(f"p{i}", prompt, max_tokens=16, min_tokens=16))
    steps = [engine.step() for _ in range(3)]
    assert all(engine.kv_tokens(f"p{i}") > 0 for i in range(3))
    before, used = engine.kv_bytes(), engine.load().kv_usage
    engine.abort_request("p2")
    assert engine.kv_tokens("p2") == 0
    assert engine.kv_bytes() < before and engine.load().kv_usage < used
    assert engine.load().running == 2
    steps += drain(engine)
    outputs = by_request(steps)
    assert len(outputs["p2"]) == 3
    for i in range(2):
        ids = loaded.encode(PROMPTS[i], None)
        assert tokens_of(outputs[f"p{i}"]) == reference(loaded, ids, 16, min_new_tokens=16)
    assert_pool_clean(engine)


def test_abort_while_waiting_or_prefilling(make):
    engine = make(max_batch=1, prefill_chunk_tokens=4)
    engine.add_request(request("long", PROMPTS[2], max_tokens=4))
    engine.add_request(request("queued", PROMPTS[0], max_tokens=4))
    engine.step()
    assert engine.kv_tokens("long") == 4
    assert engine.load().waiting == 1
    engine.abort_request("long")
    engine.abort_request("queued")
    assert engine.kv_tokens("long") == 0
    assert_pool_clean(engine)
    assert not engine.has_unfinished()
    assert engine.step() == []


def test_waiting_requests_go_earliest_deadline_first(make):
    engine = make(max_batch=1)
    engine.add_request(request("late", PROMPTS[0], deadline=300, max_tokens=2, ignore_eos=True))
    engine.add_request(request("soon", PROMPTS[0], deadline=100, max_tokens=2, ignore_eos=True))
    engine.add_request(request("middle", PROMPTS[0], deadline=200, max_tokens=2, ignore_eos=True))
    first = engine.step()
    assert [o.request_id for o in first] == ["soon"]
    engine.add_request(request("urgent", PROMPTS[0], deadline=50, max_tokens=2, ignore_eos=True))
    order = [o.request_id for step in drain(engine) for o in step if o.completion_tokens == 1]
    assert order == ["urgent", "middle", "late"]
    assert engine.load().waiting == 0


def test_long_prompt_is_chunked_and_running_streams_keep_going(make, loaded: LoadedModel):
    engine = make(prefill_chunk_tokens=32)
    engine.add_request(request("chat", PROMPTS[0], max_tokens=100, ignore_eos=True))
    engine.step()
    long_prompt = " ".join(PROMPTS * 12)
    n = len(loaded.encode(long_prompt, None))
    assert n > 200
    engine.add_request(request("long", long_prompt, max_tokens=3, ignore_eos=True))
    steps_to_first = 0
    while True:
        step = {o.request_id: o for o in engine.step()}
        steps_to_first += 1
        assert len(step["chat"].token_ids) == 1, "the running stream must not stall"
        if "long" in step:
            break
        assert engine.kv_tokens("long") == 32 * steps_to_first
        assert engine.load().running == 2
    assert steps_to_first == -(-n // 32)
    expected = reference(loaded, loaded.encode(long_prompt, None), 3)
    assert step["long"].token_ids == expected[:1]


def test_too_long_request_errors_on_next_step_without_raising(make, loaded: LoadedModel):
    engine = make()
    engine.add_request(request("ok", PROMPTS[0], max_tokens=2))
    n = len(loaded.encode(PROMPTS[1], None))
    engine.add_request(request("big", PROMPTS[1], max_tokens=loaded.max_context))
    engine.add_request(request("nochat", None))
    outputs = by_request(drain(engine))
    big = outputs["big"][0]
    assert big.error_status == 400 and big.finish_reason == "error"
    assert str(n) in big.error and str(loaded.max_context) in big.error
    assert outputs["nochat"][0].error_status == 400
    assert outputs["ok"][-1].finish_reason in ("stop", "length")


def test_passed_deadline_ends_the_request(make):
    engine = make()
    engine.add_request(request("gone", PROMPTS[0], deadline=-1, max_tokens=5))
    engine.add_request(request("fine", PROMPTS[0], max_tokens=5, ignore_eos=True))
    outputs = by_request(drain(engine))
    assert [o.finish_reason for o in outputs["gone"]] == ["deadline"]
    assert len(tokens_of(outputs["fine"])) == 5
    assert_pool_clean(engine)


def test_seeded_sampling_repeats_whatever_else_runs(make):
    def run(companions: int) -> list[int]:
        engine = make()
        engine.add_request(request("x", PROMPTS[0], max_tokens=12, temperature=0.9, top_p=0.9, seed=7))
        for i in range(companions):
            engine.add_request(request(f"c{i}", PROMPTS[i], max_tokens=12, temperature=1.0))
        return tokens_of(by_request(drain(engine))["x"])

    assert run(0) == run(3)


def test_create_measures_costs_for_load_reports(tiny_model_dir: Path, engine_device: str):
    engine = create(str(tiny_model_dir), device=engine_device, max_batch=3)
    load = engine.load()
    assert load.capacity == 3 and load.running == 0 and load.waiting == 0
    assert load.prefill_s_per_token > 0 and load.decode_step_s > 0
    assert 0 < load.decode_s_per_seq < load.decode_step_s  # a row adds less than the pass itself
    assert engine.cost.fixed_s > 0 and engine.cost.per_token_s > 0
    assert_pool_clean(engine)
    for i in range(5):
        engine.add_request(request(f"r{i}", PROMPTS[0], max_tokens=4))
    engine.step()
    load = engine.load()
    assert (load.running, load.waiting) == (3, 2)
    assert 0 < load.kv_usage < 1 and load.extra["kv_bytes"] > 0
    assert load.extra["prefill_step_s"] > 0 and load.extra["step_budget_s"] == 0.02


def test_create_names_a_bad_option(tiny_model_dir: Path):
    with pytest.raises(ValueError, match="max_batches"):
        create(str(tiny_model_dir), max_batches=3)
    with pytest.raises(ValueError, match="needs a model"):
        create(None)


@pytest.mark.parametrize("option", [{"prefill_chunk_tokens": 0}, {"min_chunk_tokens": 0}, {"max_batch": "eight"},
                                    {"step_budget_ms": -1.0}, {"cut_ins_per_step": -1}])
def test_an_option_out_of_range_is_refused_at_start(tiny_model_dir: Path, option: dict) -> None:
    """``prefill_chunk_tokens=0`` started cleanly and then ran no prompt at all: every request
    waited for its deadline."""
    with pytest.raises(ValueError, match=next(iter(option))):
        create(str(tiny_model_dir), warmup=False, **option)


def test_request_done_at_its_first_token_holds_no_kv(make, loaded: LoadedModel):
    engine = make()
    engine.add_request(request("one", PROMPTS[0], max_tokens=1))
    engine.add_request(request("two", PROMPTS[1], max_tokens=2, ignore_eos=True))
    first = {o.request_id: o for o in engine.step()}
    assert first["one"].finish_reason == "length" and len(first["one"].token_ids) == 1
    assert engine.kv_tokens("one") == 0 and engine.load().running == 1
    assert engine.kv_tokens("two") == len(loaded.encode(PROMPTS[1], None))


def test_an_earlier_deadline_overtakes_a_prompt_being_prefilled(make, loaded: LoadedModel):
    engine = make(prefill_chunk_tokens=8)
    engine.add_request(request("long", " ".join(PROMPTS), deadline=300, max_tokens=2))
    engine.step()
    assert engine.kv_tokens("long") == 8
    engine.add_request(request("urgent", PROMPTS[3], deadline=100, max_tokens=2))
    urgent = len(loaded.encode(PROMPTS[3], None))
    assert urgent < 8
    assert [o.request_id for o in engine.step()] == ["urgent"]
    assert engine.kv_tokens("long") == 8 + (8 - urgent), "the long prompt gets only what is left"


def test_a_burst_of_short_prompts_is_not_let_in_one_per_step(make) -> None:
    """Even when decoding alone fills the step budget, each step takes whole short prompts up
    to ``short_prompt_tokens``, so a burst gets its first tokens together."""
    engine = make(max_batch=16, step_budget_ms=0.001, short_prompt_tokens=512)
    engine.add_request(request("running", "one stream already decoding", max_tokens=64, ignore_eos=True))
    engine.step()
    for i in range(15):
        engine.add_request(request(f"n{i}", "the risk score of card payment " * 4, max_tokens=64, ignore_eos=True))
    first: dict[str, int] = {}
    for k in range(1, 20):
        for out in engine.step():
            first.setdefault(out.request_id, k)
    newcomers = [k for rid, k in first.items() if rid != "running"]
    assert len(newcomers) == 15
    assert max(newcomers) <= 3, f"first tokens at steps {sorted(newcomers)}"


@pytest.mark.parametrize("cut_ins", [2, 0])
def test_a_request_that_arrives_during_a_step_cuts_in_and_its_first_token_is_sent_before_the_step_ends(
        make, loaded: LoadedModel, cut_ins):
    engine = make(cut_ins_per_step=cut_ins)
    for i in range(2):
        engine.add_request(request(f"s{i}", PROMPTS[i], max_tokens=8, ignore_eos=True))
    steps = [engine.step()]
    polls = []
    sent: list[list[StepOutput]] = []

    def arrivals() -> bool:
        polls.append(len(polls))
        if len(polls) > 1:
            return False
        engine.add_request(request("late", PROMPTS[2], max_tokens=6, ignore_eos=True))
        return True

    def send(outputs: list[StepOutput]) -> None:
        assert engine.kv_tokens("s0") == len(loaded.encode(PROMPTS[0], None)), "sent while the step is paused"
        sent.append(outputs)

    steps.append(engine.step(arrivals, send))
    assert {o.request_id for o in steps[-1]} == {"s0", "s1"}
    if cut_ins:
        assert polls == [0, 1], "the tiny model has two layers: one pause between them, which looks again after a pass"
        assert [[(o.request_id, len(o.token_ids)) for o in outs] for outs in sent] == [[("late", 1)]]
        steps.insert(1, sent[0])
    else:
        assert polls == [] and sent == []
        arrivals()  # as the engine loop does once the step is over
        steps.append(engine.step(arrivals, send))
        assert {o.request_id for o in steps[-1]} == {"s0", "s1", "late"}
    steps += drain(engine)
    outputs = by_request(steps)
    assert tokens_of(outputs["late"]) == reference(loaded, loaded.encode(PROMPTS[2], None), 6, min_new_tokens=6)
    for i in range(2):
        assert tokens_of(outputs[f"s{i}"]) == reference(loaded, loaded.encode(PROMPTS[i], None), 8, min_new_tokens=8)
    assert_pool_clean(engine)


@pytest.mark.parametrize("cut_ins", [2, 1])
def test_a_request_that_arrives_during_a_cut_in_goes_next_if_the_step_allows(make, loaded: LoadedModel, cut_ins):
    """It does not wait for the rest of the step, let alone the next one: its own pass runs
    once the first newcomer's ends, as long as the step's passes allow."""
    engine = make(cut_ins_per_step=cut_ins)
    for i in range(2):
        engine.add_request(request(f"s{i}", PROMPTS[i], max_tokens=8, ignore_eos=True))
    steps = [engine.step()]
    late = iter(["late", "later"])
    sent: list[list[StepOutput]] = []

    def arrivals() -> bool:
        rid = next(late, None)
        if rid is not None:
            engine.add_request(request(rid, PROMPTS[2 + (rid == "later")], max_tokens=6, ignore_eos=True))
        return rid is not None

    steps.append(engine.step(arrivals, sent.append))
    assert [[o.request_id for o in outs] for outs in sent] == [["late"], ["later"]][:cut_ins]
    steps[1:1] = sent
    steps += drain(engine)
    outputs = by_request(steps)
    for rid, prompt in (("late", PROMPTS[2]), ("later", PROMPTS[3])):
        assert tokens_of(outputs[rid]) == reference(loaded, loaded.encode(prompt, None), 6, min_new_tokens=6)
    assert_pool_clean(engine)

def arrive_two_minutes_on(engine: StreamEngine, newcomers: list[EngineRequest]) -> tuple[list, list]:
    """Steps of two streams, ``newcomers`` arriving during the second as the engine's clock
    jumps two minutes, and the outputs the engine sent while that step was paused."""
    for i in range(2):
        engine.add_request(request(f"s{i}", PROMPTS[i], max_tokens=4, ignore_eos=True))
    steps = [engine.step()]
    arrived: list[str] = []

    def arrivals() -> bool:
        if arrived:
            return False
        arrived.append("all")
        for newcomer in newcomers:
            engine.add_request(newcomer)
        engine.clock = lambda: time.time() + 120
        return True

    sent: list[list[StepOutput]] = []
    steps.append(engine.step(arrivals, sent.append))
    return steps, sent


def test_a_request_whose_deadline_passed_does_not_cut_in(make):
    """Its deadline passed while it waited (here: on arrival, the engine's clock ahead):
    a pass for it paused the streams for an answer nobody waits for, and its token went out
    before the deadline ended it. It ends there and then, as any that expired."""
    engine = make()
    steps, sent = arrive_two_minutes_on(engine, [request("late", PROMPTS[2], deadline=60, max_tokens=4)])
    assert [[(o.request_id, o.finish_reason) for o in outs] for outs in sent] == [[("late", "deadline")]]
    assert "late" not in {o.request_id for o in steps[-1] + engine.step()}


def test_a_request_that_expired_waiting_does_not_hold_up_a_newcomer_s_cut_in(make, loaded: LoadedModel):
    """First in the queue, it was skipped but still held the batch's last place for itself,
    so the newcomer behind it waited for the next step. It ends before a cut-in is chosen."""
    engine = make(max_batch=3)
    steps, sent = arrive_two_minutes_on(engine, [request("stale", PROMPTS[3], deadline=60, max_tokens=4),
                                                 request("fresh", PROMPTS[2], max_tokens=4, ignore_eos=True)])
    assert [[(o.request_id, o.finish_reason) for o in outs] for outs in sent] == [[("stale", "deadline")],
                                                                                  [("fresh", None)]]
    steps[1:1] = sent
    steps += drain(engine)
    outputs = by_request(steps)
    assert tokens_of(outputs["fresh"]) == reference(loaded, loaded.encode(PROMPTS[2], None), 4, min_new_tokens=4)
    assert_pool_clean(engine)


def test_a_newcomer_whose_first_token_shows_no_text_goes_on_alone_until_it_does(make, loaded: LoadedModel):
    """'风' is three byte tokens: the first two show nothing. A newcomer that cuts in, or runs
    in the pass of prompts at a step's start, is not left to wait for the streams' step for
    the rest of its character."""
    text = "风险评分 is high"
    engine = scripted(make(), loaded, text, "q")
    prompt_len = len(loaded.encode("q", None))
    for i in range(2):
        engine.add_request(request(f"s{i}", "q", max_tokens=12, ignore_eos=True))
    steps = [engine.step()]
    sent: list[list[StepOutput]] = []

    def arrivals() -> bool:
        if sent:
            return False
        engine.add_request(request("cut", "q", max_tokens=12, ignore_eos=True))
        return True

    def send(outputs: list[StepOutput]) -> None:
        assert engine.kv_tokens("s0") == prompt_len, "sent while the step is paused"
        sent.append(outputs)

    steps.append(engine.step(arrivals, send))
    assert {o.request_id for o in steps[-1]} == {"s0", "s1"}
    assert [[(o.request_id, o.text) for o in outs] for outs in sent] == [[("cut", "")], [("cut", ""), ("cut", "风")]]
    steps.insert(1, [o for outs in sent for o in outs])
    engine.add_request(request("first", "q", max_tokens=12, ignore_eos=True))
    steps.append(engine.step())
    assert [(o.request_id, o.text) for o in steps[-1]] == [("first", ""), ("first", ""), ("first", "风")], (
        "a pass of new prompts that go first, its newcomer on alone"
    )
    steps += drain(engine)
    outputs = by_request(steps)
    script = loaded.tokenizer(text, add_special_tokens=False).input_ids
    assert tokens_of(outputs["cut"]) == tokens_of(outputs["first"]) == script[:12]
    for rid in ("s0", "s1", "cut", "first"):  # the paused step ran the model a layer at a time, past the script's hook
        assert "".join(o.text for o in outputs[rid]) == loaded.tokenizer.decode(tokens_of(outputs[rid])), rid
    assert_pool_clean(engine)


def test_a_newcomer_whose_first_token_shows_text_is_sent_before_its_pass_mates_go_on(make, loaded: LoadedModel):
    """Two newcomers share a pass of prompts that go first: one's first token is ' is', the
    other's the first byte of '风'. The first is sent when the pass ends, not held while the
    other goes on alone for the rest of its character."""
    text = "风险评分 is high"
    script = loaded.tokenizer(text, add_special_tokens=False).input_ids
    engine = scripted(make(), loaded, text, "q")
    k = next(i for i, token in enumerate(script) if loaded.tokenizer.decode([token]) == " is")
    words = "q" + " q" * (k // 2)  # each ' q' is two tokens: its first token is the script's k-th
    assert len(loaded.encode(words, None)) - len(loaded.encode("q", None)) == k
    for i in range(2):
        engine.add_request(request(f"s{i}", "q", max_tokens=12, ignore_eos=True))
    steps = [engine.step(), engine.step()]
    engine.add_request(request("bytes", "q", max_tokens=4, ignore_eos=True))
    engine.add_request(request("words", words, max_tokens=4, ignore_eos=True))
    sent: list[list[StepOutput]] = []
    steps.append(engine.step(None, sent.append))
    assert [(o.request_id, o.text) for o in sent[0]] == [("bytes", ""), ("words", " is")]
    assert [(o.request_id, o.text) for o in steps[-1]] == [("bytes", ""), ("bytes", "风")]
    steps.insert(2, sent[0])
    steps += drain(engine)
    outputs = by_request(steps)
    assert tokens_of(outputs["bytes"]) == script[:4]
    assert tokens_of(outputs["words"]) == script[k:k + 2] + [loaded.tokenizer.eos_token_id] * 2
    assert_pool_clean(engine)


def test_a_request_the_engine_refused_keeps_its_400_when_the_next_step_fails(loaded: LoadedModel) -> None:
    """A refusal waits in the engine for the next step; that step's pass failing must not turn
    the client's mistake into an engine failure (500). The request the pass held does fail."""
    engine = StreamEngine(loaded, StreamOptions(num_blocks=64, warmup=False))
    run, calls = engine.runner.run, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("out of memory (simulated)")
        return run(*args, **kwargs)

    engine.runner.run = flaky
    deadline = time.time() + 60
    commands = [("add", EngineRequest("bad", SamplingParams(max_tokens=4, stop_token_ids=[10**6]), deadline,
                                      prompt="hi")),
                ("add", EngineRequest("good", SamplingParams(max_tokens=4), deadline, prompt="hello")), ("stop",)]
    assert _outcomes(engine, commands) == {"bad": 400, "good": "engine failure"}
    assert_pool_clean(engine)


def _outcomes(engine: StreamEngine, commands: list) -> dict[str, object]:
    """Step ``engine`` through ``commands`` (None: nothing new at that look): each refused
    request's status, and "engine failure" for each a failed step dropped."""
    outcome: dict[str, object] = {}

    def report(r) -> None:
        if isinstance(r, Step):
            for o in r.outputs:
                if o.error:
                    outcome.setdefault(o.request_id, o.error_status)
        elif isinstance(r, Failure):
            for rid in r.request_ids:
                outcome.setdefault(rid, "engine failure")

    step_until_stopped(engine, lambda wait: commands.pop(0) if commands else None, report)
    return outcome


def test_a_request_refused_while_a_step_is_paused_keeps_its_400_when_that_step_fails(loaded: LoadedModel) -> None:
    """A request that arrives between two layers of a step and that the engine refuses is the
    client's mistake, whatever the step does next: the step failing after the pause must not
    turn its 400 into an engine failure (500)."""
    engine = StreamEngine(loaded, StreamOptions(num_blocks=64, warmup=False))
    run = engine.runner.run

    def paused_then_failed(sched, pause=None):
        if pause is None:
            return run(sched)
        pause(1)
        raise RuntimeError("out of memory (simulated)")

    engine.runner.run = paused_then_failed
    deadline = time.time() + 60
    commands = [("add", EngineRequest("good", SamplingParams(max_tokens=4), deadline, prompt="hello")), None,
                ("add", EngineRequest("bad", SamplingParams(max_tokens=4, stop_token_ids=[10**6]), deadline,
                                      prompt="hi")), ("stop",)]
    assert _outcomes(engine, commands) == {"bad": 400, "good": "engine failure"}
    assert_pool_clean(engine)
