import time

import pytest

from engines.base import EngineRequest
from engines.sim import create, stop_cut
from slogate.protocol import SamplingParams


def run(engine, *requests) -> dict[str, list]:
    for r in requests:
        engine.add_request(r)
    out: dict[str, list] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).append(o)
    return out


def req(rid: str, prompt: str = "p", **sampling) -> EngineRequest:
    return EngineRequest(rid, SamplingParams(**sampling), time.time() + 60, prompt=prompt)


def test_output_is_deterministic_in_the_prompt() -> None:
    a = run(create(decode_base_s=0), req("a", max_tokens=5), req("b", max_tokens=5))
    b = run(create(decode_base_s=0), req("c", max_tokens=5))
    text = lambda outs: "".join(o.text for o in outs)  # noqa: E731
    assert text(a["a"]) == text(a["b"]) == text(b["c"])
    assert a["a"][-1].finish_reason == "length" and a["a"][-1].completion_tokens == 5


def test_a_seed_moves_the_text_and_the_same_seed_says_it_again() -> None:
    text = lambda outs: "".join(o.text for o in outs)  # noqa: E731
    out = run(create(decode_base_s=0), req("none", max_tokens=8), req("s1", max_tokens=8, seed=1),
              req("s2", max_tokens=8, seed=2), req("s1again", max_tokens=8, seed=1),
              req("negative", max_tokens=8, seed=-(2**63)))
    texts = {rid: text(outs) for rid, outs in out.items()}
    assert texts["s1"] == texts["s1again"]
    assert len({texts["none"], texts["s1"], texts["s2"], texts["negative"]}) == 4, texts


def test_choices_seeded_apart_always_say_different_things() -> None:
    """A request of ``n`` choices seeds them ``seed``, ``seed + 1``, ... (gateway.choices): the
    text is picked by its start modulo the word list, and a start hashed from the seed
    collided there for about one request of three choices in twelve, whose choices said the
    same, whatever the seed promised."""
    text = lambda outs: "".join(o.text for o in outs)  # noqa: E731
    for seed in range(0, 300, 3):
        out = run(create(decode_base_s=0), *(req(str(i), max_tokens=4, seed=seed + i) for i in range(3)))
        assert len({text(outs) for outs in out.values()}) == 3, seed


def test_a_model_directory_is_served_under_its_name_as_the_real_engines_serve_it(tmp_path) -> None:
    """``slogate up --model DIR`` hands DIR to every pool's workers, the sim ones too: served
    under its full path, a sim pool's model was another than the real pools' beside it."""
    (tmp_path / "my-llama").mkdir()
    assert create(str(tmp_path / "my-llama")).model_id == "my-llama"
    assert create("org/hub-model").model_id == "org/hub-model"
    assert create().model_id == "slogate-sim"


def test_batch_limit_holds_requests_back() -> None:
    engine = create(decode_base_s=0, max_batch=2)
    for i in range(3):
        engine.add_request(req(str(i), max_tokens=2))
    first = engine.step()
    assert sorted(o.request_id for o in first) == ["0", "1"]
    assert engine.load().waiting == 1 and engine.load().running == 2


def test_prompt_beyond_context_is_an_error_output() -> None:
    engine = create(max_context=10, chars_per_token=1)
    outs = run(engine, req("x", prompt="y" * 8, max_tokens=5))["x"]
    assert outs[0].error and outs[0].error_status == 400 and "context" in outs[0].error


def test_a_default_max_tokens_is_lowered_to_the_room_the_prompt_leaves() -> None:
    engine = create(max_context=10, chars_per_token=1, decode_base_s=0)
    outs = run(engine, req("x", prompt="y" * 8, max_tokens=5, max_tokens_default=True))["x"]
    assert not outs[-1].error and (outs[-1].finish_reason, outs[-1].completion_tokens) == ("length", 2)


def test_abort_frees_the_request() -> None:
    engine = create(decode_base_s=0)
    engine.add_request(req("x", max_tokens=100))
    engine.step()
    engine.abort_request("x")
    assert not engine.has_unfinished()


def test_expired_deadline_finishes_with_deadline() -> None:
    engine = create(decode_base_s=0)
    engine.add_request(EngineRequest("x", SamplingParams(max_tokens=9), time.time() - 1, prompt="p"))
    assert engine.step()[0].finish_reason == "deadline"


def test_stop_cut_holds_back_partial_stops() -> None:
    assert stop_cut("hello wor", 0, ["world"]) == (6, False)
    assert stop_cut("hello world!", 6, ["world"]) == (6, True)
    assert stop_cut("abc", 0, ["x"]) == (3, False)


def test_json_output_is_refused_as_the_made_up_text_cannot_follow_a_schema() -> None:
    engine = create(decode_base_s=0)
    outs = run(engine, req("json", json_schema='{"type":"object"}'), req("free", max_tokens=3))
    (refused,) = outs["json"]
    assert (refused.error_status, refused.error_param) == (400, "response_format")
    assert outs["free"][-1].finish_reason == "length"


@pytest.mark.parametrize("option", [{"decode_base_s": "4ms"}, {"max_batch": 8.5}])
def test_an_option_of_the_wrong_type_is_refused_at_start(option: dict) -> None:
    """``-o decode_base_s=4ms`` built an engine whose load() raised in the worker's heartbeat:
    the worker ran with no heartbeat, and the stack was never ready, with nothing logged."""
    with pytest.raises(ValueError, match=next(iter(option))):
        create(**option)


@pytest.mark.parametrize("option", ["max_batch", "max_context", "chars_per_token"])
def test_a_count_below_one_is_refused_at_start(option: str) -> None:
    """``max_batch=0`` made a worker that heartbeat no capacity and took nothing while /readyz
    said ready; ``chars_per_token=0`` failed every request with a division by zero."""
    with pytest.raises(ValueError, match=option):
        create(**{option: 0})


@pytest.mark.parametrize("option", ["prefill_s_per_token", "decode_base_s", "decode_s_per_seq"])
def test_a_negative_time_is_refused_at_start(option: str) -> None:
    """Its load would report negative step times, which admission takes for a pool that serves
    everything at once."""
    with pytest.raises(ValueError, match=option):
        create(**{option: -0.001})
