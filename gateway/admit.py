"""The gateway side of the SLO policies: feed them live numbers, act on their decisions.

The decisions themselves live in ``policies/`` (pure, microseconds); this module only turns
the fleet view into their inputs and their outcomes into HTTP answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time

from gateway.errors import APIError
from gateway.schema import ParsedRequest
from gateway.state import GatewayState
from policies.admission import Decision


def retry_headers(seconds: float) -> dict[str, str]:
    """``Retry-After`` allows whole seconds only; ``retry-after-ms`` (read by the OpenAI SDKs)
    carries the real figure. A refusal that no wait helps (0: the request would miss its
    objective or deadline on an idle pool, or alone exceeds a rate limit) says
    ``x-should-retry: false`` instead, which the OpenAI SDKs obey: without it they retry every
    429, twice by default, to be refused again."""
    if seconds <= 0:
        return {"x-should-retry": "false"}
    return {"Retry-After": str(max(1, math.ceil(seconds))), "retry-after-ms": str(max(1, round(seconds * 1000)))}


async def admit(state: GatewayState, parsed: ParsedRequest, cls: str, deadline: float,
                key: str = "anonymous") -> Decision:
    """Pick the pool for a request, or raise the 429/503/504 that says why it cannot go.
    The caller brackets the admitted request with the directory's ``started``/``ended``.

    A batch request told to wait (interactive load is high on a pool it would share) is held
    here, before it costs any engine work, in the gateway's line of held requests
    (:mod:`gateway.holds`): asked about again in its turn until it may go or its deadline
    passes. One that comes while others are held, for a pool they wait for, joins the line's end
    (it would otherwise go before them) and the first in the line asks at once; one for another
    pool, or refused, is answered at once. One behind others asks each ``hold_retry_s`` too, as
    one behind them, so it goes only once its route is a pool nobody waits for (a worker came
    for its model): it waited for those ahead of it, which only the interactive load lets go.
    Where batch has no such pool, it asks nothing until its turn: a full line asking each second
    cost the loop a thousand decisions a second, all "behind-held". A full line sheds it.
    """
    if not state.cfg.admission_control:
        return _fixed_route(state, parsed, cls)
    ctl = state.admission
    # From the prompt's characters at what the key's finished requests showed a token to be
    # (policies.prompt_tokens); the worker reports the exact count afterwards.
    prompt_tokens = ctl.prompt_tokens.estimate(parsed.model, key, parsed.prompt_chars, len(parsed.messages or ()))
    max_tokens = parsed.sampling.max_tokens if parsed.max_tokens_given else None
    turn = None
    sent_at = time.time()
    hold_retry_s = state.cfg.policies.objectives.batch.hold_retry_s
    try:
        while True:
            now = time.time()
            pause = deadline - now
            behind = turn is not None and not state.holds.first(turn) and pause > 0
            if not behind or ctl.has_unshared_batch_pool:  # else every answer behind others is "behind-held"
                decision = ctl.decide(cls=cls, stream=parsed.stream, prompt_tokens=prompt_tokens,
                                      max_tokens=max_tokens, signals=state.directory.signals(), now=now,
                                      model=parsed.model, deadline=deadline, sent_at=sent_at,
                                      behind_held=behind or (turn is None and bool(state.holds)), n=parsed.n)
                if decision.admitted or (decision.outcome != "wait" and not behind):
                    state.metrics.decided(cls, decision.outcome, decision.reason)
                    break
                if turn is None:
                    turn = _join(state, parsed, cls, decision.reason)
                    if decision.reason == "behind-held":  # the load may have fallen: the first asks now
                        state.holds.wake_first()
                # asked again by its deadline, which says 504; behind others, only to go elsewhere
                pause = min(decision.retry_after_s if state.holds.first(turn) else hold_retry_s, pause)
            turn.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, pause)):
                    await turn.wait()
            if state.draining:
                raise APIError(503, "gateway is shutting down; retry on another replica", None, "shutting_down",
                               {"x-slogate-class": cls, **retry_headers(1.0)})
    finally:
        if turn is not None:
            state.holds.leave(turn)
            state.metrics.held.dec()
    if decision.admitted:
        return decision
    raise _refusal(state, cls, decision, parsed, prompt_tokens)


def _join(state: GatewayState, parsed: ParsedRequest, cls: str, reason: str) -> asyncio.Event:
    """A place at the end of the line of held requests, counted once as told to wait; or the
    429 of a full line."""
    policies = state.cfg.policies
    batch = policies.objectives.batch
    if len(state.holds) >= batch.max_held:
        state.metrics.decided(cls, "shed", "batch-queue-full")
        retry = round(min(state.holds.place_frees_in(batch.hold_retry_s), policies.admission.max_retry_after_s), 3)
        raise _refusal(state, cls, Decision("shed", "batch-queue-full", 429, retry), parsed, 0)
    state.metrics.decided(cls, "wait", reason)
    state.metrics.held.inc()
    return state.holds.join()


def _refusal(state: GatewayState, cls: str, d: Decision, parsed: ParsedRequest, prompt_tokens: int) -> APIError:
    headers = {"x-slogate-class": cls, "x-slogate-reason": d.reason}
    predicted = f"{d.predicted_s * 1000:.0f} ms" if d.predicted_s is not None else "unknown"
    if d.outcome == "expired":
        return APIError(504, "the request's deadline passed before it could be queued (batch work is held "
                             "back while interactive load is high)", None, "deadline_exceeded", headers)
    headers.update(retry_headers(d.retry_after_s))
    if d.outcome == "unavailable":
        what = ("its pool keeps failing and is paused" if d.reason == "circuit-open"
                else "no live worker can serve it" + _served_elsewhere(state, cls, parsed.model))
        return APIError(503, f"{cls} request refused: {what}; retry after {d.retry_after_s:g} s", None,
                        d.reason.replace("-", "_"), headers)
    objective = state.admission.objective(parsed.stream) * 1000
    budget = state.admission.budget(parsed.stream) * 1000
    messages = {
        "overloaded": f"{cls} capacity is full: this request (predicted {predicted}) and those admitted "
                      f"before it cannot all finish within the {objective:.0f} ms objective (admission "
                      f"targets {budget:.0f} ms); retry after {d.retry_after_s:g} s",
        "exceeds-objective": f"this request is predicted to take {predicted} even on an idle pool, beyond the "
                             f"{objective / state.cfg.policies.admission.margin:.0f} ms that fit the "
                             f"{objective:.0f} ms interactive objective with admission's margin; ",
        "batch-queue-full": f"the batch queue is full; retry after {d.retry_after_s:g} s",
        "cannot-meet-deadline": f"predicted completion ({predicted}) falls after the request's deadline",
    }
    message = messages.get(d.reason, f"request shed ({d.reason})")
    if d.reason == "exceeds-objective":
        message += (_beyond_context(state, parsed, prompt_tokens)
                    or "send it as batch (x-slogate-class: batch) or ask for fewer tokens")
    return APIError(429, message, None, d.reason.replace("-", "_"), headers)


def _beyond_context(state: GatewayState, parsed: ParsedRequest, tokens: int) -> str | None:
    """What to say of a request too slow for interactive work that would not fit the model's
    context either (its prompt estimated at ``tokens``): sent as batch it would only come back a
    400, after a wait. A default max_tokens is not counted: the worker lowers it to the room
    the prompt leaves (:func:`slogate.protocol.fit_to_context`)."""
    model = state.directory.view.models.get(parsed.model)
    sampling = parsed.sampling
    answer = sampling.max_tokens if parsed.max_tokens_given else max(1, sampling.min_tokens)
    if model is None or tokens + answer < model.max_context:
        return None
    return (f"besides, its prompt (about {tokens} tokens, counting characters a token as this key's earlier "
            f"prompts did) and max_tokens likely exceed the model's context of {model.max_context} tokens: "
            f"shorten the prompt")


def _served_elsewhere(state: GatewayState, cls: str, model: str) -> str:
    """Where a model no pool of ``cls`` serves is served after all, and how to get there."""
    routing = state.cfg.policies.routing
    serving = set(state.directory.view.pools_serving(model))
    if serving & set(routing.pools[cls]):
        return ""
    other = "batch" if cls == "interactive" else "interactive"
    if serving & set(routing.pools[other]):
        return f" in the {cls} pools, only in {other} pools (send it with x-slogate-class: {other})"
    return ""


def _fixed_route(state: GatewayState, parsed: ParsedRequest, cls: str) -> Decision:
    """Admission off: the class's first pool that serves the model. The feedback loop still
    judges the answers (its factor is a metric then), under the epoch they were sent in."""
    serving = set(state.directory.view.pools_serving(parsed.model))
    if not serving:  # its last worker left after the request was checked (awaiting the rate limit, say)
        retry = state.cfg.policies.admission.unavailable_retry_after_s
        raise _refusal(state, cls, Decision("unavailable", "no-workers", 503, retry), parsed, 0)
    pool = next((p for p in state.cfg.policies.routing.pools[cls] if p in serving), None) or sorted(serving)[0]
    return Decision("admit", "admission-off", 200, pool=pool, epoch=state.admission.feedback.epoch)
