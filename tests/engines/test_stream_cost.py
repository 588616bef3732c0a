from __future__ import annotations

import pytest

from engines.stream.cost import Ewma, StepCost


def test_fit_recovers_the_parts_of_a_step():
    cost = StepCost.fit(fixed_s=0.004, decodes=8, decode_s=0.006, tokens=256, near_s=0.012, far_start=1024,
                        far_s=0.020)
    assert cost.per_decode_s == pytest.approx(0.002 / 8)
    assert cost.per_token_per_position_s > 0
    assert cost.predict(0, [(0, 256)]) == pytest.approx(0.012, rel=0.05)
    assert cost.predict(0, [(1024, 256)]) == pytest.approx(0.020, rel=0.05)
    assert cost.predict(8) == pytest.approx(0.006)


def test_chunks_are_sized_to_the_time_left():
    cost = StepCost.fit(0.004, 8, 0.006, 256, 0.012, 1024, 0.020)
    shallow = cost.tokens_within(0.02, 0)
    deep = cost.tokens_within(0.02, 1500)
    assert 16 < deep < shallow
    for start, n in ((0, shallow), (1500, deep)):
        assert cost.prefill_s([(start, n)]) <= 0.02 < cost.prefill_s([(start, n + 2)])
    assert cost.tokens_within(0.0, 0) == 0


def test_a_slower_host_shrinks_chunks_at_once():
    cost = StepCost.fit(0.004, 8, 0.006, 256, 0.012, 1024, 0.020)
    before = cost.tokens_within(0.02, 0)
    cost.observe(8, [(0, 256)], cost.predict(8) + 2 * cost.prefill_s([(0, 256)]))
    assert cost.prefill_scale.value > 1.4 and cost.decode_scale.value == 1.0
    assert cost.tokens_within(0.02, 0) < before


def test_fast_decode_steps_do_not_enlarge_prompt_chunks():
    cost = StepCost.fit(0.004, 8, 0.006, 256, 0.012, 1024, 0.020)
    before = cost.tokens_within(0.02, 0)
    for _ in range(20):
        cost.observe(8, [], 0.003)
    assert cost.decode_step_s(8) == pytest.approx(0.003, rel=0.05)
    assert cost.tokens_within(0.02, 0) == before


def test_ewma_rises_faster_than_it_falls():
    avg = Ewma(1.0, alpha=0.1, rise=0.5)
    avg.add(3.0)
    assert avg.value == pytest.approx(2.0)
    avg.add(0.0)
    assert avg.value == pytest.approx(1.8)
