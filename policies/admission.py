"""Admit or shed: the decision the gateway makes before anything is queued.

Interactive work is admitted when its predicted latency, inflated by the margin and by the
feedback factor, fits its objective. Put the other way round (the concurrency bound): the
service time must fit the budget, and the queue wait predicted from the backlog ahead must fit
what the service time leaves. That form names why a request was shed: it can never fit, not even
on an idle pool ("exceeds-objective", retrying will not help) or the pool is busy now
("overloaded", retry after the backlog drains, or the running requests that make each step slow
turn over; or after the request that one more prompt would make late is done, see
:mod:`policies.prompt_book`). When no slot is free, only requests that hold one no longer than
a small multiple of the pool's mean may queue: under overload, slot time goes where it makes the
most on-time answers. Interactive admission never looks at batch demand, so batch can never push
interactive work out; batch bound for a pool that interactive work may use too is held back
("wait") while the interactive pools' load is high, and shed only when its bounded queue is full
or its deadline cannot be met.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal

from policies.circuit import CircuitBreaker
from policies.config import PolicyConfig
from policies.feedback import LatencyFeedback
from policies.predict import PoolEstimate, PoolSignals, Prediction
from policies.prompt_book import PromptBook
from policies.prompt_tokens import PromptTokens
from policies.routing import Route, pick

Outcome = Literal["admit", "wait", "shed", "unavailable", "expired"]

UNJUDGED = -1
"""An epoch the feedback loop never reaches: answers admitted under it are left out of it."""


@dataclass(frozen=True, slots=True)
class Decision:
    """``status`` is the HTTP status to answer with when not admitted: 429 (shed, wait),
    503 (unavailable), 504 (expired). ``reason`` is a short code for ``x-slogate-reason``;
    ``retry_after_s`` 0 on a shed means retrying the same request will not help.
    ``predicted_s``: the predicted latency (on an idle pool, for ``exceeds-objective``)."""

    outcome: Outcome
    reason: str
    status: int
    retry_after_s: float = 0.0
    predicted_s: float | None = None
    pool: str | None = None
    worker: str | None = None
    slot_ends: tuple[float, ...] = ()
    """When each of an admitted request's choices' slots should free (its own predicted wait +
    the whole answer), in their order; none when it was not predicted. The gateway keeps them
    while the choices are in flight (:class:`policies.inflight.InFlight`)."""
    epoch: int = 0
    """The feedback loop's verdicts when it was admitted: its answer is judged under them
    (:meth:`AdmissionController.observe`). ``UNJUDGED`` for a probe: let through against the
    prediction, its answer says nothing of how far to trust predictions."""
    breaker_probe: int | None = None
    """The ticket of a request its pool's half-open breaker let through as a probe
    (:meth:`policies.circuit.CircuitBreaker.acquire`): only its answer counts as the probe's."""

    @property
    def admitted(self) -> bool:
        return self.outcome == "admit"


def deadline_for(cls: str, now: float, cfg: PolicyConfig) -> float:
    """The absolute deadline a request of ``cls`` carries when the client sets none."""
    if cls == "interactive":
        return now + cfg.objectives.interactive.deadline_s
    return now + cfg.objectives.batch.deadline_s


class AdmissionController:
    """One per gateway process. Holds what is learned (per-pool costs, the feedback factor, the
    circuit breakers); everything else arrives as arguments, so it does no I/O and no clock
    reads. Not thread-safe: call it from the event loop."""

    def __init__(self, cfg: PolicyConfig) -> None:
        self.cfg = cfg
        self.estimates: dict[str, PoolEstimate] = {}
        self.breakers: dict[str, CircuitBreaker] = {}
        self.feedback = LatencyFeedback(cfg.admission.feedback)
        self._last_heard: dict[str, float] = {}
        self.prompts: dict[str, PromptBook] = {}
        self.prompt_tokens = PromptTokens()
        routing = cfg.routing
        interactive_may_use = set(routing.pools["interactive"]) | set(routing.interactive_spill)
        self._shared = set(routing.pools["batch"]) & interactive_may_use
        self.has_unshared_batch_pool = bool(set(routing.pools["batch"]) - self._shared)
        """Whether batch has a pool interactive work may not use: held requests behind others
        can go only there (``behind_held``), so without one they have nothing to ask."""

    def estimate(self, pool: str) -> PoolEstimate:
        est = self.estimates.get(pool)
        if est is None:
            est = self.estimates[pool] = PoolEstimate.prior(self.cfg.admission.estimator)
        return est

    def breaker(self, pool: str) -> CircuitBreaker:
        br = self.breakers.get(pool)
        if br is None:
            br = self.breakers[pool] = CircuitBreaker(self.cfg.circuit)
        return br

    def objective(self, stream: bool) -> float:
        target = self.cfg.objectives.interactive
        return target.ttft_p99_s if stream else target.e2e_p99_s

    def budget(self, stream: bool) -> float:
        """The predicted latency an interactive request may have and still be admitted."""
        return self.objective(stream) / (self.cfg.admission.margin * self.feedback.factor)

    def decide(self, *, cls: str, stream: bool, prompt_tokens: int, max_tokens: int | None,
               signals: Mapping[str, PoolSignals], now: float, model: str | None = None,
               deadline: float | None = None, sent_at: float | None = None,
               behind_held: bool = False, n: int = 1) -> Decision:
        """Decide for one request. ``signals`` has every pool the gateway knows (queue depth
        from Redis, the live heartbeats); ``max_tokens=None`` is costed at the pool's learned
        mean output. A held-back batch request is asked about again with its ``deadline`` and
        when it was first asked (``sent_at``, ``now`` if not given): what it would take on an
        idle pool is judged against the time it was given, not what holding it has left. An
        interactive request's whole answer must end by its ``deadline`` too.
        ``behind_held``: batch requests are held back already; one that would go to a pool they
        wait for waits behind them ("behind-held") rather than going first. ``n``: the request's
        choices, which run as ``n`` requests of one prompt: it is predicted as the last of them,
        behind the other ``n - 1`` in its pool (their prompt is prefilled once, so booked once)."""
        own = self.cfg.routing.pools[cls]
        if max_tokens is None:
            max_tokens = round(self.estimate(own[0]).completion_tokens)
        usable = {p: s if n == 1 else replace(s, in_flight=s.in_flight + n - 1)
                  for p, s in signals.items() if self.breaker(p).ready(now, n)}
        if cls == "interactive":
            budget = self.budget(stream)
            route = pick(cls, stream, prompt_tokens, max_tokens, model, usable, self.estimate, budget, self.cfg, now,
                         self.prompts, n)
            if route is None:
                return self._unavailable(own, signals, now, n)
            return self._interactive(route, budget, stream, now, deadline, now if sent_at is None else sent_at, n)
        return self._batch(own, stream, prompt_tokens, max_tokens, model, signals, usable, now, deadline,
                           now if sent_at is None else sent_at, behind_held, n)

    def prompt_book(self, pool: str) -> PromptBook:
        book = self.prompts.get(pool)
        if book is None:
            book = self.prompts[pool] = PromptBook()
        return book

    def _past_deadline(self, route: Route, deadline: float, sent_at: float) -> Decision:
        """An interactive request whose own deadline (the client's timeout) comes before its
        whole answer would: admitted, it ran into a 504 at the deadline, its engine time spent
        for nothing. Sent again once the queue ahead has gone it fits, unless its answer alone
        takes longer than the time it was given."""
        pred = route.prediction
        retry = 0.0 if pred.hold_s > deadline - sent_at else self._clamp_retry(pred.wait_s)
        return Decision("shed", "cannot-meet-deadline", 429, retry, pred.wait_s + pred.hold_s, route.pool,
                        route.worker)

    def _interactive(self, route: Route, budget: float, stream: bool, now: float, deadline: float | None,
                     sent_at: float, n: int) -> Decision:
        pred = route.prediction
        past_deadline = deadline is not None and now + pred.wait_s + pred.hold_s > deadline
        wait_budget = budget - pred.service_s
        if pred.queue_wait_s > 0 and not self._may_queue(route.pool, pred):
            wait_budget = 0.0
        book = self.prompt_book(route.pool)
        room, room_at = book.room(now, pred.priced_share)
        if not past_deadline and wait_budget >= 0 and pred.wait_s <= wait_budget and pred.prompt_share_s <= room:
            decision = self._admit("spill" if route.spilled else "fits", route, now, n)
            until = now + (pred.total_s if stream else pred.wait_s + pred.hold_s)
            book.promise(budget - pred.total_s, until, now)
            return decision
        # A relaxed loop admits beyond the margin on an idle pool: no retry that would fit is refused.
        if pred.floor_service_s > max(budget, self.objective(stream) / self.cfg.admission.margin):
            return Decision("shed", "exceeds-objective", 429, 0.0, pred.floor_service_s, route.pool, route.worker)
        # Never one that misses on an idle pool: it would teach nothing. Its deadline is judged
        # the same way: a probe goes against the learned costs, which may be what is wrong.
        fits_deadline = deadline is None or now + pred.floor_hold_s <= deadline
        if fits_deadline and self._probe_due(route.pool, now):
            return self._admit("probe", route, now, n)
        if past_deadline:
            return self._past_deadline(route, deadline, sent_at)
        if wait_budget < 0:  # fits an idle pool: the load makes each step slow
            late = pred.mean_hold_s
        else:
            late = pred.wait_s - wait_budget if pred.wait_s > wait_budget else room_at - now
        return Decision("shed", "overloaded", 429, self._clamp_retry(late), pred.total_s, route.pool, route.worker)

    def _admit(self, reason: str, route: Route, now: float, n: int) -> Decision:
        pred = route.prediction
        probe = self.breaker(route.pool).acquire(now, n)
        self.prompt_book(route.pool).book(pred.prompt_share_s, now, pred.priced_share)
        return Decision("admit", reason, 200, 0.0, pred.total_s, route.pool, route.worker,
                        pred.slot_ends(now), UNJUDGED if reason == "probe" else self.feedback.epoch,
                        breaker_probe=probe)

    def _batch(self, own: list[str], stream: bool, prompt_tokens: int, max_tokens: int, model: str | None,
               signals: Mapping[str, PoolSignals], usable: Mapping[str, PoolSignals], now: float,
               deadline: float | None, sent_at: float, behind_held: bool, n: int) -> Decision:
        target = self.cfg.objectives.batch
        if deadline is not None and now >= deadline:
            return Decision("expired", "deadline", 504)
        route = pick("batch", stream, prompt_tokens, max_tokens, model, usable, self.estimate, None, self.cfg, now,
                     choices=n)
        slot_ends: tuple[float, ...] = ()
        if route is not None:
            # The whole answer, streamed or not: a batch deadline is for all of it, not its first token.
            pool, worker = route.pool, route.worker
            predicted = route.prediction.wait_s + route.prediction.hold_s
            slot_ends = route.prediction.slot_ends(now)
        else:
            # No live worker yet: batch may still queue (workers restart), if the pool is not failing.
            queueable = next((p for p in own if p in usable or p not in signals), None)
            if queueable is None:
                return self._unavailable(own, signals, now, n)
            pool, worker, predicted = queueable, None, None
        depth = route.prediction.ahead if route is not None else usable[pool].in_flight if pool in usable else 0
        if depth >= target.max_queue:
            drain = target.hold_retry_s
            if route is not None:  # time for the excess to drain at the pool's throughput
                pred = route.prediction
                drain = pred.queue_wait_s * (depth - target.max_queue + 1) / (pred.ahead + 1)
            return Decision("shed", "batch-queue-full", 429, self._clamp_retry(drain), predicted, pool, worker)
        # The deadline is relative to when a request is sent: if its answer fits the time it was
        # given on an idle pool, the same request sent again once the backlog (or the interactive
        # load that holds it back) is gone fits; if not, no wait helps.
        if deadline is not None and route is not None and route.prediction.hold_s > deadline - sent_at:
            return Decision("shed", "cannot-meet-deadline", 429, 0.0, predicted, pool, worker)
        if pool in self._shared and behind_held:
            return Decision("wait", "behind-held", 429, target.hold_retry_s, predicted, pool, worker)
        if pool in self._shared and self._interactive_load(signals) >= target.hold_load:
            return Decision("wait", "interactive-busy", 429, target.hold_retry_s, predicted, pool, worker)
        if deadline is not None and route is not None and now + predicted > deadline:
            return Decision("shed", "cannot-meet-deadline", 429, self._clamp_retry(route.prediction.wait_s),
                            predicted, pool, worker)
        probe = self.breaker(pool).acquire(now, n)
        if route is not None:
            self.prompt_book(pool).book(route.prediction.prompt_share_s, now, route.prediction.priced_share)
        return Decision("admit", "queued", 200, 0.0, predicted, pool, worker, slot_ends, breaker_probe=probe)

    def _may_queue(self, pool: str, pred: Prediction) -> bool:
        """Whether an interactive request may wait for a slot rather than get one at once. Not
        on a pool whose costs are not learned yet (its slot ends are guesses), and not when it
        would hold its slot far longer than the pool's mean (see ``queue_hold_factor``)."""
        adm = self.cfg.admission
        if self.estimate(pool).samples < adm.estimator.min_samples:
            return False
        return not adm.queue_hold_factor or pred.hold_s <= adm.queue_hold_factor * pred.mean_hold_s

    def _probe_due(self, pool: str, now: float) -> bool:
        """Whether to let one request through a pool that predictions say is too slow.

        Costs are learned only from admitted requests; a pool that sheds everything would keep
        its last (bad) estimate for ever. One probe per ``probe_interval_s`` of silence keeps
        the estimate honest at a cost of a few requests a second that may miss the objective.
        """
        if now - self._last_heard.get(pool, 0.0) < self.cfg.admission.probe_interval_s:
            return False
        self._last_heard[pool] = now
        return True

    def _interactive_load(self, signals: Mapping[str, PoolSignals]) -> float:
        demand = capacity = 0
        for pool in self.cfg.routing.pools["interactive"]:
            sig = signals.get(pool)
            if sig is None:
                continue
            # What workers taking no new requests still hold is in the stream, not in the capacity.
            demand += max(sig.in_flight - sum(w.running + w.waiting for w in sig.workers if w.capacity <= 0), 0)
            capacity += sum(w.capacity for w in sig.workers)
        return demand / capacity if capacity else 0.0

    def _unavailable(self, own: list[str], signals: Mapping[str, PoolSignals], now: float, n: int) -> Decision:
        blocked = [self.breakers[p].retry_after(now, n) for p in own
                   if p in self.breakers and not self.breakers[p].ready(now, n)]
        if blocked:
            return Decision("unavailable", "circuit-open", 503, self._clamp_retry(min(blocked)))
        return Decision("unavailable", "no-workers", 503, self.cfg.admission.unavailable_retry_after_s)

    def _clamp_retry(self, seconds: float) -> float:
        adm = self.cfg.admission
        return round(min(max(seconds, adm.min_retry_after_s), adm.max_retry_after_s), 3)

    def observe(self, *, pool: str, cls: str, stream: bool, prompt_tokens: int, completion_tokens: int,
                queue_wait_s: float, ttft_s: float, e2e_s: float, now: float, epoch: int,
                probe: int | None = None) -> None:
        """Report a request that finished on ``pool`` (from its Final record); ``epoch`` and
        ``probe`` are its decision's (``breaker_probe``). Teaches the pool's costs, counts as a
        success for its breaker and, for interactive work, feeds the loop."""
        self.learn(pool, prompt_tokens, completion_tokens, queue_wait_s, ttft_s, e2e_s)
        self.answered(pool=pool, cls=cls, stream=stream, ttft_s=ttft_s, e2e_s=e2e_s, now=now, epoch=epoch,
                      probe=probe)

    def learn(self, pool: str, prompt_tokens: int, completion_tokens: int, queue_wait_s: float, ttft_s: float,
              e2e_s: float) -> None:
        """Teach the pool's costs from one engine request that finished: each of a request's
        ``n`` choices is one, whose own times are its cost (the request's span the choices'
        waits for each other's slots)."""
        self.estimate(pool).observe(prompt_tokens, completion_tokens, queue_wait_s, ttft_s, e2e_s,
                                    self.cfg.admission.estimator)

    def answered(self, *, pool: str, cls: str, stream: bool, ttft_s: float, e2e_s: float, now: float,
                 epoch: int, n: int = 1, probe: int | None = None) -> None:
        """A request of ``n`` choices answered, its costs learned apart (:meth:`learn`): a success
        for the pool's breaker (``n`` probes, when it is half-open and ``probe`` is its decision's
        ``breaker_probe``) and, for interactive work, a measure for the loop, as its client saw it."""
        self._last_heard[pool] = now
        self.breaker(pool).record_success(now, n, probe)
        if cls == "interactive":
            self.feedback.record((ttft_s if stream else e2e_s) / self.objective(stream), epoch)

    def observe_expired(self, *, cls: str, stream: bool, latency_s: float, measured: bool, epoch: int) -> None:
        """Report a request whose deadline passed before it finished (a 504). ``latency_s`` is
        what the objective measures when ``measured`` (a stream's first token came), else the
        time it ran, a floor of it. Interactive work tells the loop what it knows: a first token,
        on time or not, or a floor past the objective (late whatever came next). A floor under
        the objective says nothing, and is left out, as 504s are from the breaker: a client
        asking for too little time must not tighten admission or trip a pool for everyone."""
        ratio = latency_s / self.objective(stream)
        if cls == "interactive" and (measured or ratio > 1.0):
            self.feedback.record(ratio, epoch)

    def observe_failure(self, pool: str, now: float) -> None:
        """Report a request the pool failed (worker error, or no answer before the deadline).
        Client cancellations and requests this controller shed are not failures."""
        self.breaker(pool).record_failure(now)
