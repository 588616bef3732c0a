"""Latency prediction for one request on one pool, from live load and learned costs.

The model is deliberately small: a pool is ``sum(capacity)`` slots of continuous batching. A
request waits until a slot frees for it; slots free at the pool's throughput (capacity / mean
service time); then it pays prefill for its prompt and one decode step per token up to the
point the objective measures (first token when streamed, last token otherwise). Each term is a
number the gateway can see or learn, which is what lets a wrong prediction be traced.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from policies.config import Estimator


class ModelLike(Protocol):
    id: str
    max_context: int


class WorkerLoad(Protocol):
    """What a worker's heartbeat says about it; ``slogate.protocol.Heartbeat`` fits as is."""

    worker_id: str
    running: int
    waiting: int
    capacity: int
    prefill_s_per_token: float
    decode_step_s: float
    models: Sequence[ModelLike]


@dataclass(frozen=True, slots=True)
class PoolSignals:
    """One pool's live state as the gateway last read it."""

    pool: str
    queue_depth: int
    """Entries in the pool's stream not yet taken by a worker."""
    workers: Sequence[WorkerLoad]


@dataclass(slots=True)
class PoolEstimate:
    """Costs learned from finished requests on one pool (EWMA). They include what heartbeats
    cannot see (Redis hops, detokenisation), so once there are enough they are preferred."""

    prefill_s_per_token: float
    decode_s_per_token: float
    prompt_tokens: float
    completion_tokens: float
    samples: int = 0

    @classmethod
    def prior(cls, cfg: Estimator) -> PoolEstimate:
        return cls(cfg.prior_prefill_s_per_token, cfg.prior_decode_s_per_token,
                   cfg.prior_prompt_tokens, cfg.prior_completion_tokens)

    def observe(self, prompt_tokens: int, completion_tokens: int, queue_wait_s: float,
                ttft_s: float, e2e_s: float, alpha: float) -> None:
        keep = 1.0 - alpha
        decode = self.decode_s_per_token
        if completion_tokens >= 2 and e2e_s > ttft_s:
            decode = (e2e_s - ttft_s) / (completion_tokens - 1)
            self.decode_s_per_token = keep * self.decode_s_per_token + alpha * decode
        if prompt_tokens > 0:
            first = max(ttft_s - queue_wait_s - decode, 0.0) / prompt_tokens
            self.prefill_s_per_token = keep * self.prefill_s_per_token + alpha * first
        self.prompt_tokens = keep * self.prompt_tokens + alpha * prompt_tokens
        self.completion_tokens = keep * self.completion_tokens + alpha * completion_tokens
        self.samples += 1


@dataclass(frozen=True, slots=True)
class Prediction:
    queue_wait_s: float
    service_s: float
    """Prefill plus decode up to the token the objective measures."""
    ahead: int
    """Requests before this one that need a slot (queued in Redis + waiting in workers)."""
    free_slots: int

    @property
    def total_s(self) -> float:
        return self.queue_wait_s + self.service_s


def costs(workers: Sequence[WorkerLoad], est: PoolEstimate, cfg: Estimator) -> tuple[float, float]:
    """``(prefill_s_per_token, decode_s_per_token)`` for a pool: learned once there are enough
    samples, else the capacity-weighted heartbeat figures, else the prior-seeded estimate."""
    if est.samples >= cfg.min_samples:
        return est.prefill_s_per_token, est.decode_s_per_token
    cap = prefill = decode = 0.0
    for w in workers:
        if w.capacity > 0 and w.decode_step_s > 0:
            cap += w.capacity
            prefill += w.capacity * w.prefill_s_per_token
            decode += w.capacity * w.decode_step_s
    if cap == 0:
        return est.prefill_s_per_token, est.decode_s_per_token
    return (prefill / cap or est.prefill_s_per_token), decode / cap


def service_time(prefill_s_per_token: float, decode_s_per_token: float, prompt_tokens: int,
                 max_tokens: int, stream: bool) -> float:
    return prefill_s_per_token * prompt_tokens + decode_s_per_token * (1 if stream else max_tokens)


def predict(signals: PoolSignals, workers: Sequence[WorkerLoad], est: PoolEstimate, cfg: Estimator,
            prompt_tokens: int, max_tokens: int, stream: bool) -> Prediction | None:
    """Predict on ``workers`` (the pool's workers able to serve the request); None when there
    are none, since then no number means anything. Non-decreasing in queue depth and waiting."""
    capacity = free = ahead = 0
    for w in workers:
        capacity += w.capacity
        free += max(w.capacity - w.running, 0)
        ahead += w.waiting
    if capacity <= 0:
        return None
    ahead += signals.queue_depth
    prefill, decode = costs(workers, est, cfg)
    wait = 0.0
    if ahead >= free:
        mean_service = prefill * est.prompt_tokens + decode * est.completion_tokens
        wait = (ahead - free + 1) * mean_service / capacity
    return Prediction(wait, service_time(prefill, decode, prompt_tokens, max_tokens, stream), ahead, free)


def worker_score(w: WorkerLoad, est: PoolEstimate) -> float:
    """Seconds until ``w`` could start one more request, plus that request's mean cost there:
    what a worker hint minimises. Uses the worker's own step times, so a slow worker loses."""
    prefill = w.prefill_s_per_token or est.prefill_s_per_token
    decode = w.decode_step_s or est.decode_s_per_token
    mean_service = prefill * est.prompt_tokens + decode * est.completion_tokens
    backlog = w.waiting - max(w.capacity - w.running, 0) + 1
    return max(backlog, 0) * mean_service / w.capacity + mean_service
