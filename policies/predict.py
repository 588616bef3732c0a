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
    @property
    def id(self) -> str: ...
    @property
    def max_context(self) -> int: ...


class WorkerLoad(Protocol):
    """What a worker's heartbeat says about it; ``slogate.protocol.Heartbeat`` fits as is."""

    @property
    def worker_id(self) -> str: ...
    @property
    def running(self) -> int: ...
    @property
    def waiting(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    @property
    def prefill_s_per_token(self) -> float: ...
    @property
    def decode_step_s(self) -> float: ...
    @property
    def models(self) -> Sequence[ModelLike]: ...


@dataclass(frozen=True, slots=True)
class PoolSignals:
    """One pool's live state as the gateway last read it."""

    pool: str
    queue_depth: int
    """Entries in the pool's stream no worker has taken yet. Workers delete entries only when
    done, so from XLEN that is ``XLEN - sum(running + waiting)``; adding what this gateway
    admitted since its last read keeps a burst from being judged on a stale, empty queue."""
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


@dataclass(frozen=True, slots=True)
class PoolLoad:
    """A pool's workers able to serve one request, summed in one pass (this is the hot loop)."""

    capacity: int
    free: int
    """Slots not running anything."""
    waiting: int
    """Requests workers took but have not started."""
    prefill_s_per_token: float
    decode_s_per_token: float
    """Capacity-weighted heartbeat costs; 0 when no worker reported a step yet."""
    hint: str | None
    """The worker that could start one more request soonest, counting its own step times."""


def aggregate(workers: Sequence[WorkerLoad], model: str | None, tokens: int, est: PoolEstimate) -> PoolLoad:
    """Sum the workers that have capacity, serve ``model`` and fit ``tokens`` (prompt +
    max_tokens) in its context; ``model=None`` skips that check (single-model deployments)."""
    capacity = free = waiting = 0
    cap_timed = prefill = decode = 0.0
    hint, best = None, 0.0
    prompt, completion = est.prompt_tokens, est.completion_tokens
    for w in workers:
        cap = w.capacity
        if cap <= 0:
            continue
        if model is not None:
            for m in w.models:
                if m.id == model and m.max_context >= tokens:
                    break
            else:
                continue
        idle = cap - w.running
        if idle < 0:
            idle = 0
        capacity += cap
        free += idle
        waiting += w.waiting
        step = w.decode_step_s
        if step > 0:
            cap_timed += cap
            prefill += cap * w.prefill_s_per_token
            decode += cap * step
        mean_service = ((w.prefill_s_per_token or est.prefill_s_per_token) * prompt
                        + (step or est.decode_s_per_token) * completion)
        backlog = w.waiting - idle + 1
        score = (backlog * mean_service / cap if backlog > 0 else 0.0) + mean_service
        if hint is None or score < best:
            hint, best = w.worker_id, score
    if cap_timed:
        prefill, decode = prefill / cap_timed, decode / cap_timed
    return PoolLoad(capacity, free, waiting, prefill, decode, hint)


def costs(load: PoolLoad, est: PoolEstimate, cfg: Estimator) -> tuple[float, float]:
    """``(prefill_s_per_token, decode_s_per_token)`` for a pool: learned once there are enough
    samples, else the workers' heartbeat figures, else the prior-seeded estimate."""
    if est.samples >= cfg.min_samples or not load.decode_s_per_token:
        return est.prefill_s_per_token, est.decode_s_per_token
    return load.prefill_s_per_token or est.prefill_s_per_token, load.decode_s_per_token


def service_time(prefill_s_per_token: float, decode_s_per_token: float, prompt_tokens: int,
                 max_tokens: int, stream: bool) -> float:
    return prefill_s_per_token * prompt_tokens + decode_s_per_token * (1 if stream else max_tokens)


def predict(queue_depth: int, load: PoolLoad, est: PoolEstimate, cfg: Estimator,
            prompt_tokens: int, max_tokens: int, stream: bool) -> Prediction | None:
    """None when no worker can serve the request, since then no number means anything.
    Non-decreasing in queue depth and in the workers' waiting and running counts."""
    if load.capacity <= 0:
        return None
    ahead = queue_depth + load.waiting
    prefill, decode = costs(load, est, cfg)
    wait = 0.0
    if ahead >= load.free:
        mean_service = prefill * est.prompt_tokens + decode * est.completion_tokens
        wait = (ahead - load.free + 1) * mean_service / load.capacity
    return Prediction(wait, service_time(prefill, decode, prompt_tokens, max_tokens, stream), ahead, load.free)
