"""Which pool (and which worker there) a request should go to.

A class is served by its own pools first, the one predicted fastest winning. Interactive work
goes elsewhere (spills) only when its own pools would miss the objective and the spill pool is
predicted to meet it: spilling a request that will be late anyway just makes batch work late too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from policies.config import PolicyConfig
from policies.predict import PoolEstimate, PoolSignals, Prediction, aggregate, predict
from policies.prompt_book import PromptBook


@dataclass(frozen=True, slots=True)
class Route:
    pool: str
    worker: str | None
    """The worker likeliest to start it first: a hint, since any worker of the pool may claim it."""
    prediction: Prediction
    spilled: bool = False


def _best(pools: Sequence[str], signals: Mapping[str, PoolSignals],
          estimate: Callable[[str], PoolEstimate], cfg: PolicyConfig, model: str | None,
          prompt_tokens: int, max_tokens: int, stream: bool, now: float,
          prompts: Mapping[str, PromptBook], choices: int) -> Route | None:
    best: Route | None = None
    for pool in pools:
        sig = signals.get(pool)
        if sig is None:
            continue
        est = estimate(pool)
        load = aggregate(sig.workers, model, prompt_tokens + max_tokens, est)
        if not load.capacity and model is not None:
            # The prompt's length is a guess (no tokenizer here) and can run high: a worker that
            # serves the model counts it exactly, and answers 400 if it does not fit after all.
            load = aggregate(sig.workers, model, 0, est)
        pred = predict(sig.in_flight, load, est, cfg.admission.estimator, prompt_tokens, max_tokens, stream,
                       sig.own_ends, now, prompts[pool].ahead(now) if pool in prompts else 0.0, choices)
        if pred is not None and (best is None or pred.total_s < best.prediction.total_s):
            best = Route(pool, load.hint, pred)
    return best


def pick(cls: str, stream: bool, prompt_tokens: int, max_tokens: int, model: str | None,
         signals: Mapping[str, PoolSignals], estimate: Callable[[str], PoolEstimate],
         budget_s: float | None, cfg: PolicyConfig, now: float = 0.0,
         prompts: Mapping[str, PromptBook] | None = None, choices: int = 1) -> Route | None:
    """The route with the least predicted latency among ``cls``'s own pools, or a spill pool
    for interactive work when only that one fits ``budget_s``. None when no pool in
    ``signals`` (the caller leaves out pools whose circuit is open) has a worker for it.
    ``now`` is the clock the signals' slot end times and the pools' ``prompts`` are on.
    ``choices``: as :func:`policies.predict.predict` takes them."""
    books = prompts or {}
    own = _best(cfg.routing.pools[cls], signals, estimate, cfg, model, prompt_tokens, max_tokens, stream, now,
                books, choices)
    if cls != "interactive" or budget_s is None or (own is not None and own.prediction.total_s <= budget_s):
        return own
    spill = _best(cfg.routing.interactive_spill, signals, estimate, cfg, model, prompt_tokens, max_tokens, stream,
                  now, books, choices)
    if spill is not None and spill.prediction.total_s <= budget_s:
        return Route(spill.pool, spill.worker, spill.prediction, spilled=True)
    return own
