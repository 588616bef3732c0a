"""Prometheus metrics of the gateway, named as vLLM and TGI name theirs, with a prefix.

Latency buckets step by 5-10 ms up to 300 ms so that a 150 ms P99 can be read off them; a
first bucket above the objective would make the objective invisible.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

FINE_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.07, 0.08,
    0.09, 0.1, 0.11, 0.12, 0.13, 0.14, 0.15, 0.16, 0.17, 0.18, 0.19, 0.2, 0.21, 0.22, 0.23,
    0.24, 0.25, 0.26, 0.27, 0.28, 0.29, 0.3, 0.4, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1,
                     0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


@dataclass(frozen=True)
class RequestSeries:
    """The labelled series of one (class, pool, model), looked up once: ``labels()`` costs a
    lock and a dict walk, which at thousands of requests a second adds up."""

    e2e: Any
    ttft: Any
    tpot: Any
    queue_wait: Any
    prompt_tokens: Any
    generation_tokens: Any
    met: Any
    missed: Any


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self._series: dict[tuple[str, str, str], RequestSeries] = {}
        self._outcomes: dict[tuple[str, str, str, str], Any] = {}
        self._decisions: dict[tuple[str, str, str], Any] = {}
        r = registry or CollectorRegistry()
        self.registry = r
        labels = ["class", "pool", "model"]
        self.requests = Counter("slogate_requests", "Finished requests by outcome",
                                ["class", "pool", "model", "outcome"], registry=r)
        self.e2e = Histogram("slogate_e2e_request_latency_seconds", "Arrival to last byte",
                             labels, buckets=FINE_BUCKETS, registry=r)
        self.ttft = Histogram("slogate_time_to_first_token_seconds", "Arrival to first token",
                              labels, buckets=FINE_BUCKETS, registry=r)
        self.tpot = Histogram("slogate_time_per_output_token_seconds", "Mean gap between tokens",
                              labels, buckets=TOKEN_GAP_BUCKETS, registry=r)
        self.queue_wait = Histogram("slogate_queue_wait_seconds", "Enqueue to a worker taking it",
                                    labels, buckets=FINE_BUCKETS, registry=r)
        self.prompt_tokens = Counter("slogate_prompt_tokens", "Prompt tokens processed", labels, registry=r)
        self.generation_tokens = Counter("slogate_generation_tokens", "Tokens generated", labels, registry=r)
        self.in_flight = Gauge("slogate_gateway_requests_in_flight", "Requests open at this gateway", registry=r)
        self.held = Gauge("slogate_requests_held", "Batch requests this gateway holds back before queueing, "
                          "while interactive load is high", registry=r)
        self.rejected = Counter("slogate_rejected_requests", "Requests that ended before queueing: refused, "
                                "failed in the gateway (500) or left by their client (499)",
                                ["status", "code"], registry=r)
        self.admission = Counter("slogate_admission_decisions", "Admission decisions",
                                 ["class", "decision", "reason"], registry=r)
        self.objective = Counter(
            "slogate_objective_requests", "Interactive requests judged against their latency objective "
            "(streams by the first token, others by the whole answer; a request that failed missed it)",
            labels + ["met"], registry=r)
        self.queue_depth = Gauge("slogate_num_requests_waiting",
                                 "A pool's requests not running: queued in its stream or waiting in a worker",
                                 ["pool"], registry=r)
        self.running = Gauge("slogate_num_requests_running", "Requests running on a pool's workers",
                             ["pool"], registry=r)
        self.live_workers = Gauge("slogate_live_workers", "Workers with a live heartbeat", ["pool"], registry=r)
        self.kv_usage = Gauge("slogate_kv_cache_usage_ratio", "Mean KV-cache usage of a pool's workers",
                              ["pool"], registry=r)
        self.own_in_flight = Gauge("slogate_pool_requests_in_flight",
                                   "This gateway's engine requests in flight on a pool (one per choice)", ["pool"],
                                   registry=r)
        self.feedback_factor = Gauge("slogate_admission_feedback_factor",
                                     "Factor the latency feedback applies to predictions (1 = none)", registry=r)
        self.learned_cost = Gauge("slogate_admission_learned_cost_seconds",
                                  "Per-token costs admission learned from finished requests",
                                  ["pool", "phase"], registry=r)
        self.chars_per_token = Gauge("slogate_admission_prompt_chars_per_token",
                                     "Prompt characters a token, as learned from the workers' counts",
                                     ["model"], registry=r)

    def series(self, cls: str, pool: str, model: str) -> RequestSeries:
        key = (cls, pool, model)
        found = self._series.get(key)
        if found is None:
            found = self._series[key] = RequestSeries(
                self.e2e.labels(*key), self.ttft.labels(*key), self.tpot.labels(*key),
                self.queue_wait.labels(*key), self.prompt_tokens.labels(*key), self.generation_tokens.labels(*key),
                self.objective.labels(*key, "true"), self.objective.labels(*key, "false"))
        return found

    def decided(self, cls: str, decision: str, reason: str) -> None:
        key = (cls, decision, reason)
        counter = self._decisions.get(key)
        if counter is None:
            counter = self._decisions[key] = self.admission.labels(*key)
        counter.inc()

    def finished(self, cls: str, pool: str, model: str, outcome: str) -> None:
        key = (cls, pool, model, outcome)
        counter = self._outcomes.get(key)
        if counter is None:
            counter = self._outcomes[key] = self.requests.labels(*key)
        counter.inc()
