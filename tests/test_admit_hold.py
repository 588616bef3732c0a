"""A batch request held back before queueing (pure logic: the controller is a stand-in)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from types import SimpleNamespace

import pytest

from gateway.admit import admit
from gateway.errors import APIError
from gateway.holds import HoldLine
from gateway.metrics import GatewayMetrics
from gateway.schema import ParsedRequest
from gateway.state import GatewayState
from policies import config as policy_config
from policies.admission import AdmissionController, Decision
from policies.prompt_tokens import PromptTokens
from slogate.protocol import SamplingParams


class Busy:
    """Says "wait" until ``deadline``, then what the real controller says then: expired."""

    def __init__(self, retry_s: float, deadline: float) -> None:
        self.retry_s, self.deadline, self.asked = retry_s, deadline, 0
        self.prompt_tokens = PromptTokens()

    def decide(self, *, now: float, **_) -> Decision:
        self.asked += 1
        if now >= self.deadline:
            return Decision("expired", "deadline", 504)
        return Decision("wait", "interactive-busy", 429, self.retry_s)


class Until:
    """Says "wait" (retry after ``retry_s``) until ``go`` is set, then admits whoever asks, as
    the real controller does for a pool shared with interactive work: one that comes while
    others are held waits behind them. Models in ``elsewhere`` are served by a pool nobody waits
    for."""

    def __init__(self, retry_s: float) -> None:
        self.retry_s, self.go = retry_s, False
        self.elsewhere = {"other"}
        self.has_unshared_batch_pool = True
        self.prompt_tokens = PromptTokens()
        self.asked_behind = 0

    def decide(self, *, model: str, behind_held: bool, **_) -> Decision:
        self.asked_behind += behind_held
        if model in self.elsewhere:
            return Decision("admit", "queued", 200, pool="bulk")
        if behind_held:
            return Decision("wait", "behind-held", 429, self.retry_s, pool="batch")
        if self.go:
            return Decision("admit", "queued", 200, pool="batch")
        return Decision("wait", "interactive-busy", 429, self.retry_s, pool="batch")

    def objective(self, stream: bool) -> float:
        return 0.15

    budget = objective


def held_state(controller: Busy | Until, max_held: int = 1000, hold_retry_s: float = 1.0) -> SimpleNamespace:
    policies = policy_config.load({"objectives": {"batch": {"max_held": max_held, "hold_retry_s": hold_retry_s}}})
    return SimpleNamespace(cfg=SimpleNamespace(admission_control=True, policies=policies), admission=controller,
                           draining=False, holds=HoldLine(), metrics=GatewayMetrics(),
                           directory=SimpleNamespace(signals=dict))


PARSED = ParsedRequest(kind="chat", model="m", stream=False, include_usage=False, sampling=SamplingParams(),
                       max_tokens_given=True, messages=[{"role": "user", "content": "report"}])


def decisions(state: SimpleNamespace, outcome: str) -> float:
    return sum(s.value for m in state.metrics.admission.collect() for s in m.samples
               if s.name.endswith("_total") and s.labels["decision"] == outcome)


async def test_a_held_request_is_asked_again_at_its_deadline_and_gets_a_504() -> None:
    """Refused a retry-interval early, it got a 429 telling it to retry after its deadline."""
    deadline = time.time() + 0.2
    state = held_state(Busy(retry_s=1.0, deadline=deadline))
    with pytest.raises(APIError) as refused:
        await admit(state, PARSED, "batch", deadline)
    assert refused.value.status == 504 and refused.value.code == "deadline_exceeded"
    assert decisions(state, "wait") == 1 and decisions(state, "expired") == 1, "counted once each, not per look"
    assert not state.holds and state.metrics.held._value.get() == 0


async def test_a_draining_gateway_answers_what_it_holds_with_a_503() -> None:
    deadline = time.time() + 30
    controller = Busy(retry_s=0.01, deadline=deadline)
    state = held_state(controller)
    asyncio.get_running_loop().call_later(0.05, GatewayState.drain, state)
    with pytest.raises(APIError) as refused:
        await admit(state, PARSED, "batch", deadline)
    assert refused.value.status == 503 and refused.value.code == "shutting_down"
    assert controller.asked >= 2 and decisions(state, "wait") == 1
    assert not state.holds


async def test_a_drain_wakes_requests_waiting_behind_others_at_once() -> None:
    """Only the oldest looks again to go to the pool the line waits for; the ones behind it look
    each hold retry (a second) only to go elsewhere, and otherwise sleep unless woken."""
    deadline = time.time() + 30
    state = held_state(Until(retry_s=30.0))
    held = [asyncio.create_task(admit(state, PARSED, "batch", deadline)) for _ in range(3)]
    await asyncio.sleep(0.05)
    assert len(state.holds) == 3
    GatewayState.drain(state)
    results = await asyncio.wait_for(asyncio.gather(*held, return_exceptions=True), 5)
    assert [getattr(r, "code", r) for r in results] == ["shutting_down"] * 3
    assert not state.holds


def in_order(retry_s: float, deadline_s: float
             ) -> tuple[Until, SimpleNamespace, list[str], Callable[[str], Awaitable[None]]]:
    """A line held by ``Until(retry_s)``, the order in which its requests are let go, and how to
    send one by name, with a deadline ``deadline_s`` away."""
    controller = Until(retry_s=retry_s)
    state = held_state(controller)
    deadline = time.time() + deadline_s
    order: list[str] = []

    async def ask(name: str) -> None:
        await admit(state, PARSED, "batch", deadline)
        order.append(name)

    return controller, state, order, ask


async def test_held_requests_go_in_the_order_they_came() -> None:
    """The younger one's timer fires first after the load falls; before the line, it went first."""
    controller, state, order, ask = in_order(retry_s=0.3, deadline_s=30)
    older = asyncio.create_task(ask("older"))
    await asyncio.sleep(0.15)
    younger = asyncio.create_task(ask("younger"))
    await asyncio.sleep(0.2)  # the older one last asked 0.35 s ago, the younger one 0.2 s ago
    controller.go = True
    await asyncio.wait_for(asyncio.gather(older, younger), 5)
    assert order == ["older", "younger"]
    assert decisions(state, "wait") == 2 and decisions(state, "admit") == 2
    assert not state.holds and state.metrics.held._value.get() == 0


async def test_a_request_that_comes_while_others_are_held_goes_after_them() -> None:
    """The load falls; a newcomer asks before the older one's next look (half a minute away).
    Admitted on its own answer, it went first; told "behind-held", it joins the line's end and
    has the older one ask at once."""
    controller, state, order, ask = in_order(retry_s=30.0, deadline_s=60)
    older = asyncio.create_task(ask("older"))
    await asyncio.sleep(0.05)
    controller.go = True
    newer = asyncio.create_task(ask("newer"))
    await asyncio.wait_for(asyncio.gather(older, newer), 10)  # the older one asks at once, not in 30 s
    assert order == ["older", "newer"]
    assert decisions(state, "wait") == 2 and decisions(state, "admit") == 2


async def test_a_request_for_a_pool_nobody_waits_for_goes_at_once_while_others_are_held() -> None:
    """Joining the line without asking, it waited behind the held ones, up to their deadlines."""
    deadline = time.time() + 60
    state = held_state(Until(retry_s=30.0))
    held = asyncio.create_task(admit(state, PARSED, "batch", deadline))
    await asyncio.sleep(0.05)
    decision = await asyncio.wait_for(admit(state, dataclasses.replace(PARSED, model="other"), "batch", deadline),
                                      10)
    assert decision.pool == "bulk" and not held.done() and len(state.holds) == 1
    held.cancel()
    with pytest.raises(asyncio.CancelledError):
        await held


async def test_a_request_behind_others_whose_route_no_longer_waits_goes_without_them() -> None:
    """Held behind another for the pool they share with interactive work, a request whose model
    a pool nobody waits for has come to serve (its worker started) waited for the one ahead of
    it, which only the interactive load lets go, or for its own deadline: an hour for batch."""
    deadline = time.time() + 60
    controller = Until(retry_s=30.0)
    state = held_state(controller)
    ahead = asyncio.create_task(admit(state, PARSED, "batch", deadline))
    await asyncio.sleep(0.05)
    behind = asyncio.create_task(admit(state, dataclasses.replace(PARSED, model="m2"), "batch", deadline))
    await asyncio.sleep(0.05)
    assert len(state.holds) == 2
    controller.elsewhere.add("m2")
    decision = await asyncio.wait_for(behind, 10)  # asked again within the hold retry, a second
    assert decision.pool == "bulk" and not ahead.done() and len(state.holds) == 1
    assert decisions(state, "wait") == 2 and decisions(state, "admit") == 1
    controller.go = True
    state.holds.wake_first()
    assert (await asyncio.wait_for(ahead, 10)).pool == "batch"


async def test_requests_behind_others_ask_nothing_when_every_batch_pool_is_one_the_line_waits_for() -> None:
    """Behind the first, a request asks again only to go to a batch pool nobody waits for: with
    none configured, every answer was "behind-held", and each request of a full line (a thousand)
    asked the controller each hold retry, on the loop, while interactive load was high."""
    deadline = time.time() + 30
    controller = Until(retry_s=30.0)
    controller.has_unshared_batch_pool = False
    state = held_state(controller, hold_retry_s=0.02)
    held = [asyncio.create_task(admit(state, PARSED, "batch", deadline)) for _ in range(3)]
    await asyncio.sleep(0.3)
    assert len(state.holds) == 3
    assert controller.asked_behind == 2, "once each, as it joined the line"
    controller.go = True
    state.holds.wake_first()
    assert [d.pool for d in await asyncio.wait_for(asyncio.gather(*held), 10)] == ["batch"] * 3


async def test_a_full_line_sheds_batch_with_a_retry_after() -> None:
    deadline = time.time() + 30
    state = held_state(Until(retry_s=30.0), max_held=1)
    first = asyncio.create_task(admit(state, PARSED, "batch", deadline))
    await asyncio.sleep(0.05)
    with pytest.raises(APIError) as refused:
        await admit(state, PARSED, "batch", deadline)
    assert refused.value.status == 429 and refused.value.code == "batch_queue_full"
    assert refused.value.headers["Retry-After"] == "1"
    assert decisions(state, "shed") == 1 and len(state.holds) == 1
    await asyncio.sleep(1.3)  # the line has not moved for 1.3 s: not a place in the next second
    with pytest.raises(APIError) as refused:
        await admit(state, PARSED, "batch", deadline)
    assert refused.value.headers["Retry-After"] == "2" and 1300 <= int(refused.value.headers["retry-after-ms"]) < 2000
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert not state.holds


async def test_with_admission_off_answers_are_judged_under_the_loops_current_epoch() -> None:
    """Else, after the loop's first verdict, every answer would look admitted before it and the
    factor (a metric with admission off) would never move again."""
    controller = AdmissionController(policy_config.load({}))
    controller.feedback.epoch = 3
    state = SimpleNamespace(cfg=SimpleNamespace(admission_control=False, policies=controller.cfg),
                            admission=controller, directory=SimpleNamespace(
                                view=SimpleNamespace(pools_serving=lambda model: ["batch", "interactive"])))
    decision = await admit(state, PARSED, "interactive", time.time() + 30)
    assert (decision.pool, decision.reason, decision.epoch) == ("interactive", "admission-off", 3)


async def test_with_admission_off_a_model_whose_last_worker_left_is_a_503() -> None:
    """The model was served when the request was checked; its last worker left while the rate
    limit or the stream slot was asked for. No pool to route to: 503, as with admission on."""
    controller = AdmissionController(policy_config.load({}))
    state = SimpleNamespace(cfg=SimpleNamespace(admission_control=False, policies=controller.cfg),
                            admission=controller, directory=SimpleNamespace(
                                view=SimpleNamespace(pools_serving=lambda model: [])))
    with pytest.raises(APIError) as refused:
        await admit(state, PARSED, "interactive", time.time() + 30)
    assert refused.value.status == 503 and refused.value.headers["x-slogate-reason"] == "no-workers"
    assert refused.value.headers["Retry-After"] == "1"


async def test_a_prompt_that_leaves_room_for_an_answer_is_never_told_to_shorten_for_a_default_max_tokens() -> None:
    """Too slow for interactive work, a request is told whether it would fit the model's context
    as batch. Without max_tokens the default (256) is a cap that a long prompt lowers: 1,800
    tokens of a 2,048 context are served, so the advice is batch, not "shorten the prompt";
    with max_tokens 256 set by the client the same prompt would be a 400, and is told so."""

    class TooSlow(Until):
        def decide(self, **_) -> Decision:
            return Decision("shed", "exceeds-objective", 429, 0.0, 2.0, pool="interactive")

    state = held_state(TooSlow(1.0))
    state.directory.view = SimpleNamespace(models={"m": SimpleNamespace(max_context=2048)})
    long = {"messages": [{"role": "user", "content": "x" * (4 * 1800)}], "max_tokens_given": False,
            "sampling": SamplingParams(max_tokens=256, max_tokens_default=True)}
    with pytest.raises(APIError) as refused:
        await admit(state, dataclasses.replace(PARSED, **long), "interactive", time.time() + 30)
    assert "x-slogate-class: batch" in refused.value.message and "shorten" not in refused.value.message
    given = {**long, "max_tokens_given": True, "sampling": SamplingParams(max_tokens=256)}
    with pytest.raises(APIError) as refused:
        await admit(state, dataclasses.replace(PARSED, **given), "interactive", time.time() + 30)
    assert "shorten the prompt" in refused.value.message


def test_a_full_line_says_when_a_place_should_free_from_how_it_has_moved() -> None:
    now = [100.0]
    line = HoldLine(clock=lambda: now[0])
    turns = [line.join() for _ in range(5)]
    assert line.place_frees_in(1.0) == 1.0, "it just started"
    now[0] = 105.0
    assert line.place_frees_in(1.0) == 5.0, "it has not moved for 5 s"
    for turn in turns[:3]:  # a place frees every 2 s
        now[0] += 2.0
        line.leave(turn)
    assert line.place_frees_in(1.0) == 2.0
    now[0] += 0.5
    assert line.place_frees_in(1.0) == 2.0, "at its pace, not sooner because one just left"
    assert line.place_frees_in(3.0) == 3.0, "never sooner than the floor"
    for turn in turns[3:]:
        line.leave(turn)
    now[0] += 3600.0  # empty for an hour, then full again, moving every 0.5 s
    turns = [line.join() for _ in range(3)]
    for turn in turns[:2]:
        now[0] += 0.5
        line.leave(turn)
    assert line.place_frees_in(1.0) == 1.0, "the hour it stood empty is not its pace"
