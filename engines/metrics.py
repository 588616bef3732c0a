"""Prometheus metrics of one worker; the gateway exports the pool-wide
view from heartbeats, a worker its own detail (step times, prefix-cache hits)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from engines.base import EngineLoad

STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075,
                0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)
TTFT_BUCKETS = (*STEP_BUCKETS, 5.0, 10.0, 30.0, 60.0)


class WorkerMetrics:
    def __init__(self, pool: str, worker: str, engine: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        names = ["pool", "worker", "engine"]
        self.labels = (pool, worker, engine)
        self.running = Gauge("slogate_worker_requests_running", "Requests in the engine's batch", names, registry=r).labels(*self.labels)
        self.waiting = Gauge("slogate_worker_requests_waiting", "Requests held by the engine, not yet running", names, registry=r).labels(*self.labels)
        self.kv_usage = Gauge("slogate_worker_kv_cache_usage_ratio", "Share of KV-cache blocks in use", names, registry=r).labels(*self.labels)
        self.prefix_hits = Gauge("slogate_prefix_cache_hit_ratio", "Prompt tokens served from the prefix cache", names, registry=r).labels(*self.labels)
        self.decode_step = Gauge("slogate_worker_decode_step_seconds",
                                 "Recent decode-only step time, as heartbeats report it", names,
                                 registry=r).labels(*self.labels)
        self.prefill_per_token = Gauge("slogate_worker_prefill_seconds_per_token",
                                       "Recent prompt cost per token, as heartbeats report it", names,
                                       registry=r).labels(*self.labels)
        self.prefill_step = Gauge("slogate_worker_prefill_step_seconds",
                                  "Recent time of a step with prompt work (stream engine)", names,
                                  registry=r).labels(*self.labels)
        self.ttft = Histogram("slogate_worker_time_to_first_token_seconds",
                              "From taking a request off its pool's stream to its first text: the engine's share of "
                              "the gateway's slogate_time_to_first_token_seconds", names, buckets=TTFT_BUCKETS,
                              registry=r).labels(*self.labels)
        self.step = Histogram("slogate_worker_step_seconds", "Engine step duration", names, buckets=STEP_BUCKETS, registry=r).labels(*self.labels)
        self.tokens = Counter("slogate_worker_generated_tokens", "Tokens generated", names, registry=r).labels(*self.labels)
        self._finished = Counter("slogate_worker_requests", "Requests settled by this worker", [*names, "outcome"], registry=r)
        self.claimed = Counter("slogate_worker_claimed_requests", "Requests taken over from dead workers", names, registry=r).labels(*self.labels)
        self.dropped = Counter("slogate_worker_unreadable_messages", "Stream entries dropped as unreadable", names, registry=r).labels(*self.labels)

    def finished(self, outcome: str) -> None:
        self._finished.labels(*self.labels, outcome).inc()

    def load(self, load: EngineLoad) -> None:
        self.running.set(load.running)
        self.waiting.set(load.waiting)
        self.kv_usage.set(load.kv_usage)
        self.decode_step.set(load.decode_step_s)
        self.prefill_per_token.set(load.prefill_s_per_token)
        if "prefill_step_s" in load.extra:
            self.prefill_step.set(load.extra["prefill_step_s"])
        if "prefix_cache_hit_rate" in load.extra:
            self.prefix_hits.set(load.extra["prefix_cache_hit_rate"])
