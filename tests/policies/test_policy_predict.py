from __future__ import annotations

from itertools import pairwise

import pytest

from policies.config import load
from policies.inflight import InFlight
from policies.predict import PoolEstimate, aggregate, costs, predict, service_time, slot_waits
from slogate.protocol import Heartbeat, ModelInfo

EST_CFG = load({}).admission.estimator


def hb(worker_id: str = "w", running: int = 0, waiting: int = 0, capacity: int = 8,
       prefill: float = 0.0001, decode: float = 0.01, per_seq: float = 0.0) -> Heartbeat:
    return Heartbeat(worker_id=worker_id, pool="p", engine="sim", models=[ModelInfo("m", 4096)],
                     running=running, waiting=waiting, capacity=capacity,
                     prefill_s_per_token=prefill, decode_step_s=decode, decode_s_per_seq=per_seq)


def pred(in_flight: int, workers: list[Heartbeat], stream: bool = False, max_tokens: int = 8):
    est = PoolEstimate.prior(EST_CFG)
    return predict(in_flight, aggregate(workers, "m", 100 + max_tokens, est), est, EST_CFG, 100, max_tokens, stream)


def test_idle_pool_costs_only_service() -> None:
    p = pred(3, [hb(running=3)])
    assert p.queue_wait_s == 0.0
    assert p.service_s == pytest.approx(100 * 0.0001 + 8 * 0.01)


def test_streamed_service_stops_at_the_first_token() -> None:
    assert pred(0, [hb()], stream=True, max_tokens=500).service_s == pytest.approx(100 * 0.0001 + 0.01)


def test_wait_is_non_decreasing_in_flight_and_grows_once_slots_run_out() -> None:
    workers = [hb(running=6, capacity=8), hb("v", running=8, waiting=1, capacity=8)]
    predictions = [pred(n, workers) for n in range(0, 200)]
    waits = [p.queue_wait_s for p in predictions]
    assert all(a <= b for a, b in pairwise(waits))
    assert waits[15] == 0.0 and predictions[15].ahead == 0  # the 16th slot is free
    assert waits[16] > 0.0 and waits[199] > 50 * waits[16]
    assert predictions[199].ahead == 199 - 16


def test_wait_shrinks_with_capacity() -> None:
    small = pred(40, [hb(running=8)]).queue_wait_s
    big = pred(40, [hb(running=8), hb("v", running=8)]).queue_wait_s  # same requests, twice the slots
    assert 0 < big < small


def test_no_capacity_means_no_prediction() -> None:
    assert pred(0, []) is None
    assert pred(0, [hb(capacity=0)]) is None


def test_heartbeat_costs_until_enough_learned_samples() -> None:
    est = PoolEstimate.prior(EST_CFG)
    workers = [hb(decode=0.02, prefill=0.001, capacity=8), hb("v", decode=0.04, prefill=0.003, capacity=24)]
    load = aggregate(workers, None, 0, est)
    assert costs(load, est, EST_CFG) == pytest.approx((0.0, 0.0025, 0.035))  # capacity-weighted
    for _ in range(EST_CFG.min_samples):
        est.observe(100, 11, queue_wait_s=0.0, ttft_s=0.06, e2e_s=0.16, cfg=EST_CFG)
    learned = costs(load, est, EST_CFG)
    # Prefill is learned as 0.0005 per token, below what the workers measure: their floor holds.
    assert learned == pytest.approx((0.0, 0.0025, est.decode_s_per_token))
    assert learned.decode_s_per_token != pytest.approx(0.035)
    for _ in range(EST_CFG.prefill_window):
        est.observe(100, 11, queue_wait_s=0.0, ttft_s=0.5, e2e_s=0.6, cfg=EST_CFG)
    # 0.5 s to a first token of 100 tokens, 0.25 s of it the workers' own prompt cost: the rest
    # is paid whatever the prompt's length.
    learned = costs(load, est, EST_CFG)
    assert learned.prefill_s_per_token == pytest.approx(0.0025) and est.prefill_s_per_token > 0.0025
    assert learned.prefill_fixed_s == pytest.approx((est.prefill_s_per_token - 0.0025) * est.prompt_tokens)


def test_prompts_admitted_ahead_are_a_wait_spread_over_the_workers() -> None:
    est = PoolEstimate.prior(EST_CFG)
    load = aggregate([hb(prefill=0.001), hb("v", prefill=0.001)], None, 0, est)
    idle = predict(0, load, est, EST_CFG, 100, 8, False)
    assert idle.prompts_ahead_s == 0.0 and idle.wait_s == 0.0
    assert idle.prompt_share_s == pytest.approx(100 * 0.001 / 2)
    behind = predict(0, load, est, EST_CFG, 100, 8, False, prompts_ahead_s=0.2)
    assert behind.total_s == pytest.approx(idle.total_s + 0.2)
    slots_full = predict(40, load, est, EST_CFG, 100, 8, False, prompts_ahead_s=0.001)
    assert slots_full.wait_s == slots_full.queue_wait_s > 0.001  # the two waits overlap


def test_no_heartbeat_costs_fall_back_to_the_estimate() -> None:
    est = PoolEstimate.prior(EST_CFG)
    load = aggregate([hb(decode=0.0, prefill=0.0)], None, 0, est)
    assert costs(load, est, EST_CFG) == (0.0, est.prefill_s_per_token, est.decode_s_per_token)


def test_ewma_converges_to_measured_costs() -> None:
    est = PoolEstimate.prior(EST_CFG)
    # 0.01 s per decode token, 0.0005 s per prompt token, 0.2 s in the queue.
    for _ in range(200):
        ttft = 0.2 + 200 * 0.0005 + 0.01
        est.observe(200, 21, queue_wait_s=0.2, ttft_s=ttft, e2e_s=ttft + 20 * 0.01, cfg=EST_CFG)
    assert est.decode_s_per_token == pytest.approx(0.01, rel=1e-3)
    assert est.prefill_s_per_token == pytest.approx(0.0005, rel=1e-3)
    assert (est.prompt_tokens, est.completion_tokens) == (pytest.approx(200, rel=1e-3), pytest.approx(21, rel=1e-3))
    assert est.samples == 200


def test_single_token_answers_do_not_teach_decode() -> None:
    est = PoolEstimate.prior(EST_CFG)
    before = est.decode_s_per_token
    est.observe(10, 1, queue_wait_s=0.0, ttft_s=0.5, e2e_s=0.5, cfg=EST_CFG)
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
    assert (load.capacity, load.hint) == (8, "good")
    assert aggregate([other, short], None, 108, est).capacity == 16


def test_slot_wait_reads_when_own_requests_end() -> None:
    long_streams = [10.0 + 0.8] * 16
    short_scores = [10.0 + 0.01 * (i + 1) for i in range(16)]
    assert slot_waits(15, 16, long_streams[:15], now=10.0, mean_service_s=0.1, step_s=0.005) == (0.0,)
    assert slot_waits(16, 16, long_streams, now=10.0, mean_service_s=0.1, step_s=0.005) == pytest.approx((0.8,))
    assert slot_waits(16, 16, short_scores, now=10.0, mean_service_s=0.1, step_s=0.005) == pytest.approx((0.01,))
    assert slot_waits(18, 16, short_scores + [10.5, 10.6], now=10.0, mean_service_s=0.1,
                      step_s=0.005) == pytest.approx((0.03,))  # third in line: the third end
    late = [9.9] * 15 + [9.999]
    assert slot_waits(16, 16, late, now=10.0, mean_service_s=0.1, step_s=0.005) == (0.005,)
    assert slot_waits(17, 16, late, now=10.0, mean_service_s=0.1, step_s=0.005) == pytest.approx((0.1,))


def test_slot_wait_without_own_requests_is_the_mean_pace() -> None:
    for k in (1, 5, 40):
        waits = slot_waits(16 + k - 1, 16, [], now=0.0, mean_service_s=0.32, step_s=0.005)
        assert waits == pytest.approx((k * 0.02,))


class Scanned(list):
    """A gateway's own slot ends that count how often they are read through."""

    scans = 0

    def __iter__(self):
        self.scans += 1
        return super().__iter__()


def test_a_request_of_n_choices_reads_the_gateways_own_ends_once() -> None:
    """Each choice's wait read all of the gateway's own requests in flight again: while the pool
    queues, a request of many choices read hundreds of ends once per choice."""
    est = PoolEstimate.prior(EST_CFG)
    load = aggregate([hb(capacity=16, running=16)], "m", 108, est)
    ends = Scanned(10.0 + 0.01 * (i + 1) for i in range(20))
    p = predict(20, load, est, EST_CFG, 100, 8, False, own_ends=ends, now=10.0, choices=4)
    assert ends.scans == 1
    assert p.choice_waits_s == pytest.approx((0.02, 0.03, 0.04, 0.05))  # second to fifth in line


def test_in_flight_tracks_each_request_until_it_ends() -> None:
    own = InFlight()
    a, b = own.start("p", 1.0), own.start("p", 2.0)
    own.start("q", 3.0)
    assert (own.count("p"), own.count("q"), own.count("none")) == (2, 1, 0)
    own.end("p", a)
    assert (own.count("p"), list(own.ends("p"))) == (1, [2.0])
    own.end("p", b)
    assert own.count("p") == 0 and list(own.ends("none")) == []


def test_prefill_follows_the_lower_envelope() -> None:
    """Time waiting inside a busy worker lands in a request's first-token time; it must not
    be learned as prefill cost, or admission sheds the very requests that could run."""
    est = PoolEstimate.prior(EST_CFG)
    step = est.decode_s_per_token  # one-token answers: the first token is prefill plus one step

    def observe(prefill_s: float) -> None:
        est.observe(200, 1, queue_wait_s=0.0, ttft_s=prefill_s + step, e2e_s=prefill_s + step, cfg=EST_CFG)

    for _ in range(100):
        observe(200 * 0.0001)
    assert est.prefill_s_per_token == pytest.approx(0.0001, rel=0.05)
    for i in range(300):  # two requests in three waited up to 300 ms behind others
        observe(200 * 0.0001 + (0.001 * (i % 300) if i % 3 else 0.0))
    assert est.prefill_s_per_token == pytest.approx(0.0001, rel=0.05)
    for _ in range(EST_CFG.prefill_window):  # prefill really got slower: the estimate follows
        observe(200 * 0.0005)
    assert est.prefill_s_per_token == pytest.approx(0.0005, rel=0.05)


def test_priced_share_is_the_learned_slowdown_over_the_workers_own_step() -> None:
    est = PoolEstimate.prior(EST_CFG)
    load = aggregate([hb(decode=0.01)], None, 0, est)
    assert predict(0, load, est, EST_CFG, 100, 8, False).priced_share == 0.0  # heartbeat costs: nothing learned
    for _ in range(EST_CFG.min_samples):
        est.observe(100, 11, queue_wait_s=0.0, ttft_s=0.03, e2e_s=0.23, cfg=EST_CFG)  # 20 ms a token
    assert predict(0, load, est, EST_CFG, 100, 8, False).priced_share == pytest.approx(0.5)
    slow_host = aggregate([hb(decode=0.001)], None, 0, est)
    assert predict(0, slow_host, est, EST_CFG, 100, 8, False).priced_share == pytest.approx(0.9)  # capped
    fast = aggregate([hb(decode=0.05)], None, 0, est)
    assert predict(0, fast, est, EST_CFG, 100, 8, False).priced_share == 0.0


def test_decode_grows_with_the_requests_in_flight_that_heartbeats_have_not_seen() -> None:
    # The worker last saw 2 running; each running request adds 1 ms to its 10 ms step.
    est = PoolEstimate.prior(EST_CFG)
    load = aggregate([hb(running=2, decode=0.010, capacity=32, per_seq=0.001)], "m", 108, est)
    seen = predict(2, load, est, EST_CFG, 100, 8, False)
    burst = predict(20, load, est, EST_CFG, 100, 8, False)
    full = predict(100, load, est, EST_CFG, 100, 8, False)
    assert seen.service_s == pytest.approx(100 * 0.0001 + 8 * 0.011)  # only the request itself is new
    assert burst.service_s == pytest.approx(100 * 0.0001 + 8 * 0.029)  # 21 running, not 2
    assert full.service_s == pytest.approx(100 * 0.0001 + 8 * 0.040)  # no more than the 32 slots run
    assert burst.floor_service_s == pytest.approx(100 * 0.0001 + 8 * 0.009)  # one running, not two
    silent = aggregate([hb(running=2, decode=0.010, capacity=32)], "m", 108, est)  # a worker that does not say
    assert predict(20, silent, est, EST_CFG, 100, 8, False).service_s == pytest.approx(100 * 0.0001 + 8 * 0.010)


def test_prompts_book_the_engine_time_the_workers_report_not_the_hops() -> None:
    """The learned prompt cost carries the hops to the worker; booked as engine time, a
    gateway in front of workers that take no time at all shed most of its load."""
    est = PoolEstimate.prior(EST_CFG)
    for _ in range(EST_CFG.min_samples):  # 5 ms to a first token, of which the engine took 1
        est.observe(100, 8, queue_wait_s=0.0, ttft_s=0.005, e2e_s=0.012, cfg=EST_CFG)
    timed = aggregate([hb(prefill=0.00001, decode=0.001), hb("v", prefill=0.00001, decode=0.001)], "m", 108, est)
    p = predict(0, timed, est, EST_CFG, 100, 8, False)
    assert p.service_s > 100 * 0.00004  # the latency still counts the hops
    assert p.prompt_share_s == pytest.approx(100 * 0.00001 / 2)
    idle_engines = aggregate([hb(prefill=0.0, decode=0.0)], "m", 108, est)
    assert predict(0, idle_engines, est, EST_CFG, 100, 8, False).prompt_share_s == 0.0


def test_a_long_prompt_is_costed_at_the_engine_pace_beyond_the_fixed_part() -> None:
    # First tokens of 100-token prompts take 12 ms; the engine's share is 2 ms (0.02 ms a token).
    est = PoolEstimate.prior(EST_CFG)
    for _ in range(EST_CFG.prefill_window):
        est.observe(100, 8, queue_wait_s=0.0, ttft_s=0.012 + 0.005, e2e_s=0.017 + 7 * 0.005, cfg=EST_CFG)
    load = aggregate([hb(prefill=0.00002, decode=0.005)], "m", 0, est)
    typical = predict(0, load, est, EST_CFG, 100, 1, True)
    long = predict(0, load, est, EST_CFG, 2000, 1, True)
    assert typical.service_s == pytest.approx(0.012 + 0.005)  # what was learned, at the mean prompt
    assert long.service_s == pytest.approx(0.010 + 2000 * 0.00002 + 0.005)  # not 20 x 12 ms
    assert long.floor_service_s == pytest.approx(2000 * 0.00002 + 0.005)  # engine time alone
    assert service_time(costs(load, est, EST_CFG), 100, 1, True) == pytest.approx(typical.service_s)
