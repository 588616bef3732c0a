"""Which pool (and which worker there) a request should go to.

A class is served by its own pools first, the one predicted fastest winning. Interactive work
goes elsewhere (spills) only when its own pools would miss the objective and the spill pool is
predicted to meet it: spilling a request that will be late anyway just makes batch work late too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from policies.config import PolicyConfig
from policies.predict import PoolEstimate, PoolSignals, Prediction, WorkerLoad, predict, worker_score


@dataclass(frozen=True, slots=True)
class Route:
    pool: str
    worker: str | None
    """The worker likeliest to start it first: a hint, since any worker of the pool may claim it."""
    prediction: Prediction
    spilled: bool = False


def eligible(workers: Sequence[WorkerLoad], model: str | None, tokens: int) -> list[WorkerLoad]:
    """Workers that have capacity, serve ``model`` and fit ``tokens`` (prompt + max_tokens) in
    its context. ``model=None`` skips the model check (a single-model deployment)."""
    out = []
    for w in workers:
        if w.capacity <= 0:
            continue
        if model is not None and not any(m.id == model and m.max_context >= tokens for m in w.models):
            continue
        out.append(w)
    return out


def _best(pools: Sequence[str], signals: Mapping[str, PoolSignals],
          estimate: Callable[[str], PoolEstimate], cfg: PolicyConfig, model: str | None,
          prompt_tokens: int, max_tokens: int, stream: bool) -> Route | None:
    best: Route | None = None
    for pool in pools:
        sig = signals.get(pool)
        if sig is None:
            continue
        workers = eligible(sig.workers, model, prompt_tokens + max_tokens)
        est = estimate(pool)
        pred = predict(sig, workers, est, cfg.admission.estimator, prompt_tokens, max_tokens, stream)
        if pred is None or (best is not None and pred.total_s >= best.prediction.total_s):
            continue
        hint = min(workers, key=lambda w: worker_score(w, est)).worker_id
        best = Route(pool, hint, pred)
    return best


def pick(cls: str, stream: bool, prompt_tokens: int, max_tokens: int, model: str | None,
         signals: Mapping[str, PoolSignals], estimate: Callable[[str], PoolEstimate],
         budget_s: float | None, cfg: PolicyConfig) -> Route | None:
    """The route with the least predicted latency among ``cls``'s own pools, or a spill pool
    for interactive work when only that one fits ``budget_s``. None when no pool in
    ``signals`` (the caller leaves out pools whose circuit is open) has a worker for it."""
    own = _best(cfg.routing.pools[cls], signals, estimate, cfg, model, prompt_tokens, max_tokens, stream)
    if cls != "interactive" or budget_s is None or (own is not None and own.prediction.total_s <= budget_s):
        return own
    spill = _best(cfg.routing.interactive_spill, signals, estimate, cfg, model, prompt_tokens, max_tokens, stream)
    if spill is not None and spill.prediction.total_s <= budget_s:
        return Route(spill.pool, spill.worker, spill.prediction, spilled=True)
    return own
