"""How a request's choices are made and counted as one (pure logic; the end-to-end behaviour is
in ``tests/e2e/test_choices_e2e.py``)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from gateway.choices import as_one, fan_out
from gateway.completions import _Job
from gateway.schema import ParsedRequest
from slogate.protocol import Final, GenerateRequest, SamplingParams


def request(seed: int | None) -> GenerateRequest:
    return GenerateRequest(id="r", model="m", pool="interactive", cls="interactive",
                           sampling=SamplingParams(temperature=0.7, seed=seed), deadline=time.time() + 30,
                           enqueued_at=time.time(), reply="x", prompt="p")


def test_each_choice_is_a_request_of_its_own_seeded_apart_within_64_bits() -> None:
    choices = fan_out(request(2**63 - 2), 4)
    assert [c.id for c in choices] == ["r", "1-r", "2-r", "3-r"]
    assert [c.sampling.seed for c in choices] == [2**63 - 2, 2**63 - 1, -(2**63), -(2**63) + 1]
    assert all(c.prompt == "p" and c.sampling.temperature == 0.7 for c in choices)
    assert [c.sampling.seed for c in fan_out(request(None), 3)] == [None, None, None]
    lone = request(5)
    assert fan_out(lone, 1) == [lone], "a request of one choice is sent as it is"


def choice(index: int, **fields) -> _Job:
    gen = request(None)
    parsed = ParsedRequest(kind="chat", model="m", stream=True, include_usage=False, sampling=gen.sampling,
                           max_tokens_given=True, n=3)
    return _Job(SimpleNamespace(), parsed, gen, None, time.time(), {}, index=index, **fields)


def answered(index: int, ended_at: float, first_token_at: float, queue_wait_s: float, tokens: int) -> _Job:
    return choice(index, outcome="stop", ended_at=ended_at, first_token_at=first_token_at, prompt_tokens=7,
                  completion_tokens=tokens, final=Final("stop", 7, tokens, queue_wait_s=queue_wait_s))


def test_a_request_is_counted_once_with_the_prompt_once_and_the_completions_summed() -> None:
    whole = as_one([answered(0, 10.0, 2.0, 0.5, 4), answered(1, 12.0, 1.0, 0.1, 9), answered(2, 11.0, 3.0, 0.9, 5)])
    assert (whole.prompt_tokens, whole.completion_tokens, whole.outcome) == (7, 18, "stop")
    assert whole.ended_at == 12.0 and whole.final.completion_tokens == 9, "the last choice spans the request"
    assert whole.first_token_at == 1.0 and whole.final.queue_wait_s == 0.1, "the first token, with its queue wait"


def test_a_failed_choice_is_the_requests_failure_and_one_left_unanswered_its_client_leaving() -> None:
    late = choice(2, outcome="deadline_exceeded", status=504, completion_tokens=3, prompt_tokens=7)
    whole = as_one([answered(0, 10.0, 2.0, 0.5, 4), choice(1, completion_tokens=2), late])
    assert (whole.outcome, whole.status, whole.final, whole.completion_tokens) == ("deadline_exceeded", 504, None, 9)
    left = as_one([answered(0, 10.0, 2.0, 0.5, 4), choice(1, completion_tokens=2, prompt_tokens=7)])
    assert (left.outcome, left.status, left.final, left.first_token_at) == ("cancelled", 0, None, 2.0)
