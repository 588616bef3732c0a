from __future__ import annotations

from itertools import pairwise

import pytest

from policies.config import load
from policies.predict import PoolEstimate, aggregate, costs, predict
from slogate.protocol import Heartbeat, ModelInfo

EST_CFG = load({}).admission.estimator


def hb(worker_id: str = "w", running: int = 0, waiting: int = 0, capacity: int = 8,
       prefill: float = 0.0001, decode: float = 0.01) -> Heartbeat:
    return Heartbeat(worker_id=worker_id, pool="p", engine="sim", models=[ModelInfo("m", 4096)],
                     running=running, waiting=waiting, capacity=capacity,
                     prefill_s_per_token=prefill, decode_step_s=decode)


def pred(queue_depth: int, workers: list[Heartbeat], stream: bool = False, max_tokens: int = 8):
    est = PoolEstimate.prior(EST_CFG)
    return predict(queue_depth, aggregate(workers, "m", 100 + max_tokens, est), est, EST_CFG, 100, max_tokens, stream)


def test_idle_pool_costs_only_service() -> None:
    p = pred(0, [hb(running=3)])
    assert p.queue_wait_s == 0.0
    assert p.service_s == pytest.approx(100 * 0.0001 + 8 * 0.01)


def test_streamed_service_stops_at_the_first_token() -> None:
    assert pred(0, [hb()], stream=True, max_tokens=500).service_s == pytest.approx(100 * 0.0001 + 0.01)


def test_wait_is_non_decreasing_in_queue_depth_and_grows_once_slots_run_out() -> None:
    workers = [hb(running=6, capacity=8), hb("v", running=8, waiting=1, capacity=8)]
    waits = [pred(d, workers).queue_wait_s for d in range(0, 200)]
    assert all(a <= b for a, b in pairwise(waits))
    assert waits[0] == 0.0  # 2 free slots, 1 waiting ahead
    assert waits[1] > 0.0 and waits[199] > 50 * waits[1]


def test_wait_shrinks_with_capacity() -> None:
    small = pred(40, [hb(running=8)]).queue_wait_s
    big = pred(40, [hb(running=8), hb("v", running=8)]).queue_wait_s
    assert 0 < big < small


def test_no_capacity_means_no_prediction() -> None:
    assert pred(0, []) is None
    assert pred(0, [hb(capacity=0)]) is None


def test_heartbeat_costs_until_enough_learned_samples() -> None:
    est = PoolEstimate.prior(EST_CFG)
    workers = [hb(decode=0.02, prefill=0.001, capacity=8), hb("v", decode=0.04, prefill=0.003, capacity=24)]
    load = aggregate(workers, None, 0, est)
    assert costs(load, est, EST_CFG) == pytest.approx((0.0025, 0.035))  # capacity-weighted
    for _ in range(EST_CFG.min_samples):
        est.observe(100, 11, queue_wait_s=0.0, ttft_s=0.06, e2e_s=0.16, alpha=EST_CFG.alpha)
    learned = costs(load, est, EST_CFG)
    assert learned == (est.prefill_s_per_token, est.decode_s_per_token)
    assert learned != pytest.approx((0.0025, 0.035))


def test_no_heartbeat_costs_fall_back_to_the_estimate() -> None:
    est = PoolEstimate.prior(EST_CFG)
    load = aggregate([hb(decode=0.0, prefill=0.0)], None, 0, est)
    assert costs(load, est, EST_CFG) == (est.prefill_s_per_token, est.decode_s_per_token)


def test_ewma_converges_to_measured_costs() -> None:
    est = PoolEstimate.prior(EST_CFG)
    # 0.01 s per decode token, 0.0005 s per prompt token, 0.2 s in the queue.
    for _ in range(200):
        ttft = 0.2 + 200 * 0.0005 + 0.01
        est.observe(200, 21, queue_wait_s=0.2, ttft_s=ttft, e2e_s=ttft + 20 * 0.01, alpha=EST_CFG.alpha)
    assert est.decode_s_per_token == pytest.approx(0.01, rel=1e-3)
    assert est.prefill_s_per_token == pytest.approx(0.0005, rel=1e-3)
    assert (est.prompt_tokens, est.completion_tokens) == (pytest.approx(200, rel=1e-3), pytest.approx(21, rel=1e-3))
    assert est.samples == 200


def test_single_token_answers_do_not_teach_decode() -> None:
    est = PoolEstimate.prior(EST_CFG)
    before = est.decode_s_per_token
    est.observe(10, 1, queue_wait_s=0.0, ttft_s=0.5, e2e_s=0.5, alpha=0.5)
    assert est.decode_s_per_token == before


def test_hint_prefers_free_and_fast_workers() -> None:
    est = PoolEstimate.prior(EST_CFG)
    assert aggregate([hb("full", running=8, waiting=3), hb("free", running=2)], None, 0, est).hint == "free"
    assert aggregate([hb("slow", decode=0.05), hb("fast", decode=0.01)], None, 0, est).hint == "fast"


def test_only_workers_that_serve_the_request_count() -> None:
    est = PoolEstimate.prior(EST_CFG)
    other = Heartbeat(worker_id="other", pool="p", engine="sim", models=[ModelInfo("x", 4096)],
                      running=0, waiting=0, capacity=8)
    short = Heartbeat(worker_id="short", pool="p", engine="sim", models=[ModelInfo("m", 64)],
                      running=0, waiting=0, capacity=8)
    load = aggregate([other, short, hb("good", running=7, waiting=2), hb("off", capacity=0)], "m", 108, est)
    assert (load.capacity, load.free, load.waiting, load.hint) == (8, 1, 2, "good")
    assert aggregate([other, short], None, 108, est).capacity == 16
