"""Latency prediction for one request on one pool, from live load and learned costs.

The model is deliberately small: a pool is ``sum(capacity)`` slots of continuous batching
holding the requests in flight there. A request beyond the slots waits until one frees for it,
which the gateway reads off when its own requests in flight should end (other gateways' free
theirs at the pool's mean pace); then it pays prefill for its prompt and one decode step per
token up to the point the objective measures (first token when streamed, last token otherwise).
Each term is a number the gateway can see or learn, which is what lets a wrong prediction be
traced.

Slots alone say a continuous batch is free up to its size, and it is not: the prompts admitted
before a request are a wait of their own (``prompts_ahead_s``, from
:class:`policies.prompt_book.PromptBook`).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from policies.config import Estimator

MAX_PRICED_SHARE = 0.9
"""A learned decode cost ten times the workers' own step says more about the host than about
prompts; crediting more than this would let prompts through on a slowdown nobody measured."""


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
    def decode_s_per_seq(self) -> float: ...
    @property
    def quiet_step_s(self) -> float: ...
    @property
    def quiet_prefill_s_per_token(self) -> float: ...
    @property
    def models(self) -> Sequence[ModelLike]: ...


@dataclass(frozen=True, slots=True)
class PoolSignals:
    """One pool's live state as the gateway last read it."""

    pool: str
    in_flight: int
    """Requests sent to the pool and not finished: queued in its stream, waiting in a worker
    or running. The gateway counts its own exactly, as they start and end; other gateways'
    come from the stream's length (workers delete an entry when it is done) at the last read.
    Heartbeats' running counts are a second old, and at hundreds of requests a second a count
    that old is fiction, so slots are judged on this number instead."""
    workers: Sequence[WorkerLoad]
    own_ends: Collection[float] = ()
    """When the slots of this gateway's own requests in flight should free (absolute times,
    from :class:`policies.inflight.InFlight`); the rest of ``in_flight`` is other gateways'."""


@dataclass(slots=True)
class PoolEstimate:
    """Costs learned from finished requests on one pool: decode and the token means as EWMAs,
    prefill as a low windowed quantile (see ``Estimator.prefill_quantile``). They include what
    heartbeats cannot see (Redis hops, detokenisation), so once there are enough they are
    preferred."""

    prefill_s_per_token: float
    decode_s_per_token: float
    prompt_tokens: float
    completion_tokens: float
    samples: int = 0
    _prefill_samples: deque[float] = field(default_factory=deque)
    _decode_seen: bool = False

    @classmethod
    def prior(cls, cfg: Estimator) -> PoolEstimate:
        return cls(cfg.prior_prefill_s_per_token, cfg.prior_decode_s_per_token,
                   cfg.prior_prompt_tokens, cfg.prior_completion_tokens)

    def observe(self, prompt_tokens: int, completion_tokens: int, queue_wait_s: float,
                ttft_s: float, e2e_s: float, cfg: Estimator) -> None:
        alpha = cfg.alpha
        keep = 1.0 - alpha
        decode = self.decode_s_per_token
        if not self.samples:  # a first measurement beats the prior
            self.prompt_tokens, self.completion_tokens = prompt_tokens, completion_tokens
        if completion_tokens >= 2 and e2e_s > ttft_s:
            decode = (e2e_s - ttft_s) / (completion_tokens - 1)
            seen = self._decode_seen
            self.decode_s_per_token = keep * self.decode_s_per_token + alpha * decode if seen else decode
            self._decode_seen = True
        if prompt_tokens > 0:
            first = max(ttft_s - queue_wait_s - decode, 0.0) / prompt_tokens
            window = self._prefill_samples
            if window.maxlen != cfg.prefill_window:
                window = self._prefill_samples = deque(window, maxlen=cfg.prefill_window)
            window.append(first)
            ordered = sorted(window)
            self.prefill_s_per_token = ordered[int(cfg.prefill_quantile * (len(ordered) - 1))]
        self.prompt_tokens = keep * self.prompt_tokens + alpha * prompt_tokens
        self.completion_tokens = keep * self.completion_tokens + alpha * completion_tokens
        self.samples += 1


@dataclass(frozen=True, slots=True)
class Prediction:
    queue_wait_s: float
    """Until a slot is free."""
    service_s: float
    """Prefill plus decode up to the token the objective measures."""
    hold_s: float
    """Prefill plus decode up to max_tokens: how long the request keeps its slot."""
    mean_hold_s: float
    """How long the pool's requests keep a slot on average."""
    ahead: int
    """Requests before this one still waiting for a slot."""
    prompts_ahead_s: float = 0.0
    """Until the prompts admitted before this one are prefilled."""
    prompt_share_s: float = 0.0
    """What this request's prompt adds to ``prompts_ahead_s`` of the requests after it: its
    prefill at the workers' own cost (none before they report one), spread over the workers."""
    priced_share: float = 0.0
    """The share of the workers' time that the learned decode cost already gives to other
    requests' prompts: 1 - (the workers' own decode step / the learned cost per token)."""
    floor_service_s: float = 0.0
    """``service_s`` on an idle pool, at the workers' own step costs: when even this misses the
    objective, no wait makes the request fit, and retrying will not help."""
    floor_hold_s: float = 0.0
    """``hold_s`` likewise: the least the whole answer takes, by which a request is told apart
    that misses its deadline whatever the learned costs say."""
    choice_waits_s: tuple[float, ...] = ()
    """Each of a request's choices' own ``queue_wait_s``, the last being the request's: the
    earlier ones are ahead of it in line, and take slots that free sooner."""

    @property
    def wait_s(self) -> float:
        """Slot and prompts ahead overlap (prompts queued for a slot are prefilled while it
        frees), so the longer of the two."""
        return max(self.queue_wait_s, self.prompts_ahead_s)

    @property
    def total_s(self) -> float:
        return self.wait_s + self.service_s

    def slot_ends(self, now: float) -> tuple[float, ...]:
        """When each choice's slot should free: its own wait (at least the prompts ahead, as
        ``wait_s``), then its whole answer."""
        return tuple(now + max(wait, self.prompts_ahead_s) + self.hold_s for wait in self.choice_waits_s)


@dataclass(frozen=True, slots=True)
class PoolLoad:
    """A pool's workers able to serve one request, summed in one pass (this is the hot loop)."""

    capacity: int
    workers: int
    prefill_s_per_token: float
    decode_s_per_token: float
    """Capacity-weighted heartbeat costs; 0 when no worker reported a step yet."""
    decode_s_per_seq: float
    """What one more running request adds to a worker's decode step (capacity-weighted); 0
    when the workers do not say."""
    running: int
    """Requests running on these workers at their last heartbeat."""
    quiet_step_s: float
    """The shortest quiet decode step any of these workers reported; 0 when none did."""
    quiet_prefill_s_per_token: float
    """The lowest prompt cost per token any of these workers reported; 0 when none did."""
    hint: str | None
    """The worker that could start one more request soonest, counting its own step times."""
    parked: int = 0
    """Requests held by workers that take no new ones (draining or paused: no capacity). They
    are in the pool's stream, so in ``in_flight``, yet hold none of the slots counted here."""


def aggregate(workers: Sequence[WorkerLoad], model: str | None, tokens: int, est: PoolEstimate) -> PoolLoad:
    """Sum the workers that have capacity, serve ``model`` and fit ``tokens`` (prompt +
    max_tokens) in its context; ``model=None`` skips that check (single-model deployments)."""
    capacity = count = running = parked = 0
    cap_timed = prefill = decode = per_seq = quiet = quiet_prefill = 0.0
    hint, best = None, 0.0
    prompt, completion = est.prompt_tokens, est.completion_tokens
    for w in workers:
        cap = w.capacity
        if cap <= 0:
            parked += w.running + w.waiting
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
        count += 1
        running += w.running
        if w.quiet_step_s and (not quiet or w.quiet_step_s < quiet):
            quiet = w.quiet_step_s
        if w.quiet_prefill_s_per_token and (not quiet_prefill or w.quiet_prefill_s_per_token < quiet_prefill):
            quiet_prefill = w.quiet_prefill_s_per_token
        step = w.decode_step_s
        if step > 0:
            cap_timed += cap
            prefill += cap * w.prefill_s_per_token
            decode += cap * step
            per_seq += cap * w.decode_s_per_seq
        mean_service = ((w.prefill_s_per_token or est.prefill_s_per_token) * prompt
                        + (step or est.decode_s_per_token) * completion)
        backlog = w.waiting - idle + 1
        score = (backlog * mean_service / cap if backlog > 0 else 0.0) + mean_service
        if hint is None or score < best:
            hint, best = w.worker_id, score
    if cap_timed:
        prefill, decode, per_seq = prefill / cap_timed, decode / cap_timed, per_seq / cap_timed
    return PoolLoad(capacity, count, prefill, decode, per_seq, running, quiet, quiet_prefill, hint, parked)


def unseen_growth(in_flight: int, load: PoolLoad) -> float:
    """How much longer a decode step will be, per worker, once the requests in flight (and one
    more) run, than the workers last reported. Heartbeats are a second old and learned costs
    older still: under a sudden burst both describe the idle pool it found, while every
    admitted request makes each step longer."""
    if not load.decode_s_per_seq or not load.workers:
        return 0.0
    extra = min(in_flight + 1, load.capacity) - load.running
    return load.decode_s_per_seq * max(extra, 0) / load.workers


class Costs(NamedTuple):
    prefill_fixed_s: float
    """What a first token costs whatever the prompt's length (hops to the worker and back)."""
    prefill_s_per_token: float
    decode_s_per_token: float


def costs(load: PoolLoad, est: PoolEstimate, cfg: Estimator) -> Costs:
    """A pool's costs: learned once there are enough samples, else the workers' heartbeat
    figures, else the prior-seeded estimate.

    The learned prompt cost is a first token's time (less a step) over its prompt, so it spreads
    what every first token pays (the hops) over the tokens of the prompts it was learned from.
    Where the workers report their own cost per prompt token, that is the pace beyond: the rest
    of the learned figure, at the pool's mean prompt, is the fixed part. Without the split, a
    prompt ten times the mean was costed ten times the hops (a 2,000-token prompt that ran in
    50 ms was predicted at over a second), and a short one nearly none. Prefill is never taken
    below what the workers measure: when other prompts share and slow the step taken off
    (bursts), nothing is left of the learned figure, which would make every prompt look free."""
    engine = load.prefill_s_per_token
    if est.samples >= cfg.min_samples or not load.decode_s_per_token:
        learned = max(est.prefill_s_per_token, engine)
        if not engine:
            return Costs(0.0, learned, est.decode_s_per_token)
        return Costs((learned - engine) * est.prompt_tokens, engine, est.decode_s_per_token)
    return Costs(0.0, engine or est.prefill_s_per_token, load.decode_s_per_token)


def service_time(c: Costs, prompt_tokens: float, max_tokens: float, stream: bool) -> float:
    return c.prefill_fixed_s + c.prefill_s_per_token * prompt_tokens + c.decode_s_per_token * (
        1 if stream else max_tokens)


def slot_waits(in_flight: int, capacity: int, own_ends: Collection[float], now: float,
               mean_service_s: float, step_s: float, choices: int = 1) -> tuple[float, ...]:
    """Time until a slot is free for one more request: with ``k`` requests already in line for
    one, the ``k + 1``-th of the requests in flight to end frees it. This gateway knows when
    its own should end; other gateways' hold their share of the slots and free them at the
    pool's mean pace (with none of its own, that is ``k`` mean service times over
    ``capacity``). A request already past its predicted end was underestimated: it is taken
    to need as long again as it is late (at least one step).

    One wait for each of a request's ``choices``, the last of which ``in_flight`` counts, each
    in line behind the one before. The own ends are read once for them all: they number in the
    hundreds while the pool queues, and a request of many choices read them once per choice."""
    first = in_flight - choices + 1
    if in_flight < capacity:
        return (0.0,) * choices
    own = heapq.nsmallest(in_flight - capacity + 1, [max(abs(end - now), step_s) for end in own_ends])
    return tuple(_kth_end(n, capacity, own, len(own_ends), mean_service_s) for n in range(first, in_flight + 1))


def _kth_end(in_flight: int, capacity: int, own: list[float], own_count: int, mean_service_s: float) -> float:
    """``slot_waits`` for ``in_flight``, given the earliest of this gateway's ``own_count``
    requests' remaining times, in order (at least as many as it takes)."""
    ahead = in_flight - capacity
    if ahead < 0:
        return 0.0
    k = ahead + 1
    remaining = own[:k]
    others = in_flight - own_count
    if others > 0:
        spacing = mean_service_s * in_flight / (others * capacity)
        remaining += [spacing * j for j in range(1, min(others, k) + 1)]
    return heapq.nsmallest(k, remaining)[-1]


def predict(in_flight: int, load: PoolLoad, est: PoolEstimate, cfg: Estimator, prompt_tokens: int,
            max_tokens: int, stream: bool, own_ends: Collection[float] = (), now: float = 0.0,
            prompts_ahead_s: float = 0.0, choices: int = 1) -> Prediction | None:
    """None when no worker can serve the request, since then no number means anything.
    Non-decreasing in ``in_flight`` and in ``prompts_ahead_s``. ``choices``: the request's,
    all but the last of which ``in_flight`` counts already, each in line behind the one before."""
    if load.capacity <= 0:
        return None
    in_flight = max(in_flight - load.parked, 0)
    c = costs(load, est, cfg)
    growth = unseen_growth(in_flight, load)
    c = c._replace(decode_s_per_token=c.decode_s_per_token + growth)
    mean_service = service_time(c, est.prompt_tokens, est.completion_tokens, False)
    waits = slot_waits(in_flight, load.capacity, own_ends, now, mean_service, c.decode_s_per_token, choices)
    step = load.decode_s_per_token + growth
    priced = 1.0 - step / c.decode_s_per_token if load.decode_s_per_token and c.decode_s_per_token else 0.0
    # What a prompt takes of the engine, which is what later prompts wait behind: the workers'
    # own figure (0 before they report one), not the learned one, which carries the hops: they
    # are not engine time, and no prompt queues behind them.
    return Prediction(waits[-1], service_time(c, prompt_tokens, max_tokens, stream),
                      service_time(c, prompt_tokens, max_tokens, False), mean_service,
                      max(in_flight - load.capacity, 0), prompts_ahead_s,
                      load.prefill_s_per_token * prompt_tokens / load.workers,
                      min(max(priced, 0.0), MAX_PRICED_SHARE),
                      floor_service(load, c, prompt_tokens, max_tokens, stream),
                      floor_service(load, c, prompt_tokens, max_tokens, False), waits)


def floor_service(load: PoolLoad, c: Costs, prompt_tokens: int, max_tokens: int, stream: bool) -> float:
    """Service time on an idle pool: engine time alone, at the workers' own prompt cost and
    their decode step with one request running, where they report them, and never above their
    quiet step and quiet prompt cost (a host busy with other work slows every step, and
    passes); else the costs the prediction uses. It decides that a request can never fit,
    which the client is told not to retry, so it leaves out what load, contention and hops may
    add."""
    if load.decode_s_per_token:
        busy = load.decode_s_per_seq * max(load.running / load.workers - 1, 0.0)
        idle_step = max(load.decode_s_per_token - busy, load.decode_s_per_seq)
        if load.quiet_step_s:
            idle_step = min(idle_step, load.quiet_step_s)
        c = c._replace(decode_s_per_token=min(c.decode_s_per_token, idle_step))
    if load.prefill_s_per_token:
        prefill = min(c.prefill_s_per_token, load.prefill_s_per_token, load.quiet_prefill_s_per_token or math.inf)
        c = c._replace(prefill_fixed_s=0.0, prefill_s_per_token=prefill)
    return service_time(c, prompt_tokens, max_tokens, stream)
