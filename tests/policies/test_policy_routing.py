from __future__ import annotations

from policies.config import PolicyConfig, load
from policies.predict import PoolEstimate, PoolSignals
from policies.routing import pick
from slogate.protocol import Heartbeat, ModelInfo

CFG = load({"routing": {"pools": {"interactive": ["fast-a", "fast-b"], "batch": ["paged"]},
                        "interactive_spill": ["paged"]}})


def hb(worker_id: str, running: int = 0, waiting: int = 0, capacity: int = 8, decode: float = 0.01,
       models: tuple[tuple[str, int], ...] = (("m", 4096),)) -> Heartbeat:
    return Heartbeat(worker_id=worker_id, pool="p", engine="sim", models=[ModelInfo(*m) for m in models],
                     running=running, waiting=waiting, capacity=capacity,
                     prefill_s_per_token=0.0001, decode_step_s=decode)


def route(signals: dict[str, PoolSignals], cls: str = "interactive", budget: float | None = 0.125,
          max_tokens: int = 8, model: str | None = "m", cfg: PolicyConfig = CFG):
    estimates: dict[str, PoolEstimate] = {}

    def estimate(pool: str) -> PoolEstimate:
        return estimates.setdefault(pool, PoolEstimate.prior(cfg.admission.estimator))

    return pick(cls, False, 100, max_tokens, model, signals, estimate, budget, cfg)


def busy(pool: str, depth: int, decode: float = 0.01) -> PoolSignals:
    """``depth`` requests queued behind 8 running on the pool's one 8-slot worker."""
    return PoolSignals(pool, depth + 8, [hb(f"{pool}-1", running=8, decode=decode)])


def idle(pool: str, decode: float = 0.01) -> PoolSignals:
    return PoolSignals(pool, 1, [hb(f"{pool}-1", running=1, decode=decode)])


def test_least_predicted_own_pool_wins() -> None:
    r = route({"fast-a": busy("fast-a", 30), "fast-b": idle("fast-b"), "paged": idle("paged")})
    assert (r.pool, r.worker, r.spilled) == ("fast-b", "fast-b-1", False)


def test_worker_hint_is_the_least_loaded_worker() -> None:
    sig = PoolSignals("fast-a", 0, [hb("full", running=8, waiting=2), hb("free", running=1), hb("slow", decode=0.1)])
    assert route({"fast-a": sig}).worker == "free"


def test_spills_only_when_own_pools_miss_and_spill_meets() -> None:
    signals = {"fast-a": busy("fast-a", 40), "fast-b": busy("fast-b", 40), "paged": idle("paged", decode=0.012)}
    r = route(signals)
    assert (r.pool, r.spilled) == ("paged", True)
    assert r.prediction.total_s <= 0.125


def test_no_spill_when_own_pool_meets_even_if_spill_is_faster() -> None:
    signals = {"fast-a": idle("fast-a", decode=0.012), "paged": idle("paged", decode=0.005)}
    assert route(signals).pool == "fast-a"


def test_no_spill_when_spill_would_miss_too() -> None:
    signals = {"fast-a": busy("fast-a", 40), "paged": busy("paged", 500)}
    r = route(signals)
    assert (r.pool, r.spilled) == ("fast-a", False)
    assert r.prediction.total_s > 0.125


def test_spill_rescues_a_pool_without_workers() -> None:
    signals = {"fast-a": PoolSignals("fast-a", 0, []), "paged": idle("paged")}
    assert route(signals).spilled


def test_batch_never_spills_into_interactive_pools() -> None:
    signals = {"fast-a": idle("fast-a"), "paged": busy("paged", 10_000)}
    assert route(signals, cls="batch", budget=None).pool == "paged"
    assert route({"fast-a": idle("fast-a")}, cls="batch", budget=None) is None


def test_workers_without_the_model_or_the_context_are_skipped() -> None:
    other = hb("other", models=(("x", 4096),))
    short = hb("short", models=(("m", 64),))
    good = hb("good", running=7)
    assert route({"fast-a": PoolSignals("fast-a", 0, [other, short, good])}).worker == "good"
    assert route({"fast-a": PoolSignals("fast-a", 0, [other])}, budget=None) is None
    assert route({"fast-a": PoolSignals("fast-a", 0, [other])}, model=None).worker == "other"
    # The gateway's guess at the prompt's length (100 + 8 here) is beyond every context that
    # serves the model: the worker's exact count decides, not a 503.
    assert route({"fast-a": PoolSignals("fast-a", 0, [other, short])}).worker == "short"
