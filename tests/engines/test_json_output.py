"""Output held to a JSON schema (``response_format``) by both engines, on the tiny model: every
output parses and matches its schema, whether sampled greedily or not, batched beside free text,
preempted for memory, or cut by ``max_tokens``."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import pytest
from transformers import AutoTokenizer

from engines.base import EngineRequest, StepOutput
from engines.paged import PagedEngine, create
from engines.runtime.grammar import Grammars
from engines.stream import create as stream_create
from slogate import json_output
from slogate.processes import ROOT
from slogate.protocol import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

VERDICT = {
    "type": "object",
    "properties": {
        "risk": {"type": "integer", "minimum": 0, "maximum": 100},
        "label": {"enum": ["approve", "review", "decline"]},
        "reasons": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["risk", "label", "reasons"],
    "additionalProperties": False,
}
SCHEMAS = [
    VERDICT,
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"flag": {"type": "boolean"}, "card": {"type": "string", "pattern": "^[0-9]{4}$"}},
     "required": ["flag", "card"], "additionalProperties": False},
]
PROMPTS = ["score this card payment", "a long risk report on the merchant", "is the transfer fraud"]
MakeEngine = Callable[..., PagedEngine]


@pytest.fixture(params=["paged", "stream"])
def make_engine(request: pytest.FixtureRequest, tiny_model_dir: Path, engine_device: str) -> MakeEngine:
    build = create if request.param == "paged" else stream_create

    def make(**options: Any) -> PagedEngine:
        options.setdefault("num_blocks", 256)
        return build(str(tiny_model_dir), dtype="fp32", device=engine_device, **options)

    return make


def _sampling(schema: dict[str, Any] | str, **kw: Any) -> SamplingParams:
    text = schema if isinstance(schema, str) else json.dumps(schema)
    return SamplingParams(**{"max_tokens": 200, "temperature": 0.0, "json_schema": text, **kw})


def _run(engine: PagedEngine, requests: list[tuple[str, str, SamplingParams]]) -> dict[str, list[StepOutput]]:
    for rid, prompt, sampling in requests:
        engine.add_request(EngineRequest(rid, sampling, time.time() + 3600, prompt=prompt))
    outputs: dict[str, list[StepOutput]] = {}
    for _ in range(10_000):
        if not engine.has_unfinished():
            return outputs
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError("engine did not finish")


def _result(outs: list[StepOutput]) -> tuple[str, str | None, int]:
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return "".join(o.text for o in outs), outs[-1].finish_reason, sum(len(o.token_ids) for o in outs)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_parses_and_matches_its_schema(make_engine: MakeEngine, temperature: float) -> None:
    engine = make_engine()
    requests = [(f"r{i}-{j}", prompt, _sampling(schema, temperature=temperature, seed=i * 10 + j))
                for i, schema in enumerate(SCHEMAS) for j, prompt in enumerate(PROMPTS)]
    outputs = _run(engine, requests)
    for rid, _, sampling in requests:
        text, finish, tokens = _result(outputs[rid])
        assert finish == "stop", (rid, text)
        jsonschema.validate(json.loads(text), json.loads(sampling.json_schema or ""))
        assert tokens < sampling.max_tokens


def test_the_model_left_alone_writes_no_json(make_engine: MakeEngine) -> None:
    """The control for the test above: without the schema the same requests are not JSON, so
    what holds them to it is the engine, not the model."""
    engine = make_engine()
    free = SamplingParams(max_tokens=60, temperature=0.0)
    outputs = _run(engine, [(f"r{j}", prompt, free) for j, prompt in enumerate(PROMPTS)])
    for outs in outputs.values():
        with pytest.raises(ValueError):
            json.loads(_result(outs)[0])


def test_free_text_beside_json_is_untouched(make_engine: MakeEngine) -> None:
    free = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    alone = _run(make_engine(), [("free", PROMPTS[0], free)])
    beside = _run(make_engine(), [("free", PROMPTS[0], free)]
                  + [(f"json{i}", PROMPTS[1], _sampling(s)) for i, s in enumerate(SCHEMAS)])
    assert [o.token_ids for o in beside["free"]] == [o.token_ids for o in alone["free"]]


def test_output_stays_valid_across_preemption(tiny_model_dir: Path, engine_device: str) -> None:
    """A pool of 224 token slots for eight requests of up to 110 tokens: some are preempted and
    recomputed, their matchers kept, and still end in valid JSON."""
    engine = create(str(tiny_model_dir), dtype="fp32", device=engine_device, block_size=8, num_blocks=28)
    numbers = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
               "minItems": 12, "maxItems": 12}
    requests = [(f"r{i}", f"case {i}: " + " ".join([PROMPTS[i % 3]] * (1 + i % 6)),
                 _sampling(numbers, temperature=1.0, seed=i, max_tokens=80)) for i in range(8)]
    outputs = _run(engine, requests)
    assert engine.scheduler.num_preemptions > 0
    for rid, _, _ in requests:
        jsonschema.validate(json.loads(_result(outputs[rid])[0]), numbers)


def test_max_tokens_cuts_the_json_with_length(make_engine: MakeEngine) -> None:
    text, finish, tokens = _result(_run(make_engine(), [("r", PROMPTS[0], _sampling(VERDICT, max_tokens=5))])["r"])
    assert (finish, tokens) == ("length", 5)
    assert text.startswith('{"')
    with pytest.raises(ValueError):
        json.loads(text)


def test_json_complete_on_the_last_token_max_tokens_allows_is_a_stop(make_engine: MakeEngine) -> None:
    """The SDK's ``parse`` raises on ``length``: complete JSON must not be reported as cut."""
    engine = make_engine()
    text, _, tokens = _result(_run(engine, [("free", PROMPTS[0], _sampling(VERDICT))])["free"])
    exact = _result(_run(engine, [("exact", PROMPTS[0], _sampling(VERDICT, max_tokens=tokens))])["exact"])
    assert exact == (text, "stop", tokens)
    jsonschema.validate(json.loads(text), VERDICT)


def test_min_tokens_gives_way_to_a_complete_json(make_engine: MakeEngine) -> None:
    """``min_tokens`` bans EOS and stop tokens early; a grammar that is done ends the output
    anyway, valid, instead of being forced past its end."""
    text, finish, tokens = _result(_run(make_engine(), [
        ("r", PROMPTS[0], _sampling({"type": "boolean"}, min_tokens=20, stop_token_ids=[1, 2, 3]))])["r"])
    assert finish == "stop" and tokens < 20
    assert json.loads(text) in (True, False)


def test_log_probabilities_come_with_json_output(make_engine: MakeEngine) -> None:
    outs = _run(make_engine(), [("r", PROMPTS[2], _sampling(VERDICT, logprobs=2))])["r"]
    text, _, tokens = _result(outs)
    entries = [e for o in outs for e in o.logprobs]
    assert len(entries) == tokens
    assert b"".join(e.raw for e in entries).decode() == text


def test_a_schema_that_cannot_compile_fails_that_request_alone(make_engine: MakeEngine) -> None:
    outputs = _run(make_engine(), [("bad", PROMPTS[0], _sampling('{"type": "nope"}')),
                                   ("good", PROMPTS[0], _sampling(VERDICT))])
    (bad,) = outputs["bad"]
    assert (bad.error_status, bad.error_param) == (400, "response_format.json_schema.schema")
    assert "nope" in (bad.error or "")
    jsonschema.validate(json.loads(_result(outputs["good"])[0]), VERDICT)


def test_a_tool_calls_schema_that_fails_is_named_by_the_field_it_came_from(make_engine: MakeEngine) -> None:
    """A tool call's arguments are held to its function's parameters: an error names them."""
    param = "tools[1].function.parameters"
    outputs = _run(make_engine(), [("bad", PROMPTS[0], _sampling('{"type": "nope"}', schema_param=param))])
    (bad,) = outputs["bad"]
    assert (bad.error_status, bad.error_param) == (400, param)
    assert (bad.error or "").startswith(f"cannot hold the output to '{param}': "), bad.error


def test_json_object_mode_is_any_object(make_engine: MakeEngine) -> None:
    """Any object may nest or run on without end, and the tiny model's keys do; a bias towards
    quotes and closing braces (ids of the tiny tokenizer, checked here) brings it to an end."""
    engine = make_engine()
    tokenizer = engine.loaded.tokenizer
    assert (tokenizer.decode([6]), tokenizer.decode([97])) == ('"', "}")
    sampling = _sampling(json_output.ANY_OBJECT, logit_bias={6: 6.0, 97: 3.0})
    text, finish, _ = _result(_run(engine, [("r", PROMPTS[0], sampling)])["r"])
    assert finish == "stop" and json.loads(text) and isinstance(json.loads(text), dict)


def test_a_large_schema_compiles_beside_the_running_streams(make_engine: MakeEngine) -> None:
    """A schema of 1,000 patterned properties takes about 0.3 s to compile: on a thread, so the
    step after it arrives runs the stream already there without waiting for it. Compiled
    between two steps, that step would come after the compile, with the newcomer in it."""
    engine = make_engine()
    pattern = "^([a-z]{2}|[0-9]{3}){1,%d}-[A-Z]{%d}x{0,%d}$"
    big = {"type": "object", "properties": {f"k{i}": {"type": "string", "pattern": pattern % (i % 30 + 1, i % 20 + 2,
                                                                                               i % 10 + 3)}
                                            for i in range(1000)}}
    engine.add_request(EngineRequest("free", SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True),
                                     time.time() + 3600, prompt=PROMPTS[0]))
    engine.step()
    engine.add_request(EngineRequest("big", _sampling(big, max_tokens=8), time.time() + 3600, prompt=PROMPTS[1]))
    outputs = engine.step()
    assert [o.request_id for o in outputs if o.token_ids] == ["free"]
    assert (engine.load().running, engine.load().waiting) == (1, 1)
    outputs += [o for outs in _run(engine, []).values() for o in outs]
    big_outputs = [o for o in outputs if o.request_id == "big"]
    assert all(o.error is None for o in big_outputs), big_outputs
    assert big_outputs[-1].finish_reason in ("stop", "length")


def test_masks_block_all_but_the_grammars_tokens_and_leave_a_failed_matcher_a_token(tiny_model_dir: Path) -> None:
    """A failed matcher's row must leave a token of the vocabulary to sample (EOS), not a row of
    -inf whose argmax is token 0 by accident and whose draw is NaN; the request then ends with
    the matcher's error instead of a step failing the whole batch."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    grammars = Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    compiled = grammars.compile(json_output.ANY_OBJECT)
    fresh, failed = grammars.start(compiled), grammars.start(compiled)
    [brace] = tokenizer("{", add_special_tokens=False).input_ids
    [letter] = tokenizer("a", add_special_tokens=False).input_ids
    assert not failed.consume_token(letter) and failed.is_error()
    blocked = grammars.blocked([fresh, failed])
    assert blocked.shape == (2, len(tokenizer))
    allowed = (~blocked[0]).nonzero().flatten().tolist()
    assert brace in allowed and all(tokenizer.decode([t]).startswith("{") for t in allowed)
    assert (~blocked[1]).nonzero().flatten().tolist() == [tokenizer.eos_token_id]


def test_a_schema_compiles_once_and_each_request_gets_a_matcher_of_its_own(make_engine: MakeEngine) -> None:
    engine = make_engine()
    text = json.dumps(VERDICT)
    compiled = engine.grammars.compile(text)
    assert engine.grammars.compile(text) is compiled
    one, two = engine.grammars.start(compiled), engine.grammars.start(compiled)
    [brace] = engine.loaded.tokenizer("{", add_special_tokens=False).input_ids
    assert one.consume_token(brace)
    assert engine.grammars.start(compiled).consume_token(brace) and two.consume_token(brace)


def test_a_request_given_up_while_its_schema_waits_drops_the_compile(make_engine: MakeEngine) -> None:
    """Behind a compile under way, a request's schema waits; when that request is aborted and no
    other waits for it, its compile is cancelled rather than run for nobody."""
    engine = make_engine()
    pattern = "^([a-z]{2}|[0-9]{3}){1,%d}-[A-Z]{%d}x{0,%d}$"
    slow = [json.dumps({"type": "object", "properties": {
        f"k{i}": {"type": "string", "pattern": pattern % (i % 30 + 1, i % 20 + 2, i % 10 + 3 + n)}
        for i in range(450)}}) for n in range(2)]
    under_way = engine.grammars.compile(slow[0])
    engine.add_request(EngineRequest("queued", _sampling(slow[1]), time.time() + 3600, prompt=PROMPTS[0]))
    queued = engine.grammars.compile(slow[1])
    engine.abort_request("queued")
    assert queued.cancelled() and not under_way.cancelled()
    assert _run(engine, [("next", PROMPTS[1], _sampling(VERDICT))]).keys() == {"next"}


def test_a_tokenizer_with_tokens_beyond_the_models_logits_still_holds_json(tiny_model_dir: Path) -> None:
    """An added token the model was not resized for: llguidance reads the whole tokenizer, and
    the masks are cut back to the model's logits."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    vocab = len(tokenizer)
    tokenizer.add_tokens(["<risk-label>"])
    grammars = Grammars(tokenizer, vocab, [tokenizer.eos_token_id])
    matcher = grammars.start(grammars.compile(json_output.ANY_OBJECT))
    assert grammars.blocked([matcher]).shape == (1, vocab)


def test_json_output_is_refused_naming_response_format_where_llguidance_cannot_read_the_tokenizer(
        make_engine: MakeEngine) -> None:
    """Such a tokenizer (llguidance reads only fast ones; an object stands in for it) fails JSON
    requests, naming the field the client sent, and serves free text."""
    engine = make_engine()
    engine.grammars = Grammars(object(), engine.loaded.vocab_size, engine.loaded.eos_token_ids)
    outputs = _run(engine, [("object", PROMPTS[0], _sampling(json_output.ANY_OBJECT)),
                            ("schema", PROMPTS[0], _sampling(VERDICT)),
                            ("free", PROMPTS[0], SamplingParams(max_tokens=3, temperature=0.0))])
    for rid in ("object", "schema"):
        (refused,) = outputs[rid]
        assert (refused.error_status, refused.error_param) == (400, "response_format")
        assert "tokenizer" in (refused.error or "")
    assert _result(outputs["free"])[2] == 3


def test_a_ref_chain_as_deep_as_the_size_cap_allows_compiles_and_decodes(tiny_model_dir: Path) -> None:
    """The engine's compile thread has the stack llguidance's recursion needs (1,100 levels
    killed a default thread with SIGSEGV); decoding down the chain runs on the engine's
    thread. In a process of its own, so that a regression fails this test alone."""
    probe = ("import sys\nfrom transformers import AutoTokenizer\nfrom engines.runtime.grammar import Grammars\n"
             "from tests.test_json_schemas import chain\n"
             "tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])\n"
             "grammars = Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id])\n"
             "matcher = grammars.start(grammars.compile(chain('plain', 1100)))\n"
             "[bracket] = tokenizer('[', add_special_tokens=False).input_ids\n"
             "for _ in range(1100):\n"
             "    assert not grammars.blocked([matcher])[0, bracket]\n"
             "    grammars.advance([matcher], [bracket])\n"
             "print(matcher.is_error(), grammars.blocked([matcher])[0, bracket].item())\n")
    result = subprocess.run([sys.executable, "-c", probe, str(tiny_model_dir)], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert result.stdout.split() == ["False", "True"]


def test_a_request_whose_schema_is_kept_cuts_in_like_free_text(tiny_model_dir: Path, engine_device: str) -> None:
    """Its schema compiled for an earlier request, it starts as it arrives, mid-step: its first
    token is sent while the step is paused, as a free-text newcomer's is."""
    engine = stream_create(str(tiny_model_dir), dtype="fp32", device=engine_device, num_blocks=256)
    engine.grammars.compile(json.dumps(VERDICT)).result()
    engine.add_request(EngineRequest("s0", SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0),
                                     time.time() + 3600, prompt=PROMPTS[0]))
    engine.step()
    sent: list[StepOutput] = []
    added: list[str] = []

    def arrivals() -> bool:
        if added:
            return False
        added.append("late")
        engine.add_request(EngineRequest("late", _sampling(VERDICT), time.time() + 3600, prompt=PROMPTS[1]))
        return True

    engine.step(arrivals, sent.extend)
    assert [o.request_id for o in sent if o.token_ids][:1] == ["late"]


def test_a_pattern_past_llguidances_limits_fails_its_request_and_is_not_kept(make_engine: MakeEngine) -> None:
    """Eight ``(a{300}){300}`` alternatives took 22 ms of every step at llguidance's default
    limits; within ours the request ends with a 400. Copies of a compile share its lexer's
    budget, so the spent compile is dropped: the next request with it compiles afresh."""
    engine = make_engine()
    alternatives = "|".join(f"({c}{{300}}){{300}}" for c in "abcdefgh")
    schema = json.dumps({"type": "string", "pattern": f"^({alternatives})$"})
    first = engine.grammars.compile(schema)
    outputs = _run(engine, [("costly", PROMPTS[0], _sampling(schema, max_tokens=400, temperature=1.0, seed=1)),
                            ("free", PROMPTS[1], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))])
    refused = outputs["costly"][-1]
    assert (refused.finish_reason, refused.error_status, refused.error_param) == (
        "error", 400, "response_format.json_schema.schema")
    assert "lexer" in (refused.error or "")
    assert engine.grammars.compile(schema) is not first
    assert _result(outputs["free"])[2] == 20


def test_a_kept_schema_serves_on_once_its_requests_have_filled_its_lexer(
        make_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Copies of a kept compile share its lexer, and llguidance's limit on lexer states with it,
    which the requests it serves fill up one after another: at our limits a 4,000-value enum
    failed its 24,312th request, and every request beside it, with a 400. Here a limit of 150
    states, far above what one request of a 50-value enum needs, met after some 50 rounds."""
    limits = json_output.LIMITS
    monkeypatch.setattr(json_output, "LIMITS", llguidance.LLParserLimits(
        max_items_in_row=limits.max_items_in_row, max_lexer_states=150, initial_lexer_fuel=limits.initial_lexer_fuel,
        step_lexer_fuel=limits.step_lexer_fuel, verbose_errors=False))
    rng = random.Random(0)
    values = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(8)) for _ in range(50)]
    schema = json.dumps({"enum": values})
    engine = make_engine()
    for round_ in range(100):
        outputs = _run(engine, [(f"{round_}-{i}", PROMPTS[i % 3], _sampling(schema, temperature=1.0, seed=100 * round_ + i))
                                for i in range(8)])
        for outs in outputs.values():
            text, finish, _ = _result(outs)
            assert finish == "stop" and json.loads(text) in values
