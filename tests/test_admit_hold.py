"""A batch request held back before queueing (pure logic: the controller is a stand-in)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from gateway.admit import admit
from gateway.errors import APIError
from gateway.metrics import GatewayMetrics
from gateway.schema import ParsedRequest
from policies.admission import Decision
from slogate.protocol import SamplingParams


class Busy:
    """Says "wait" until ``deadline``, then what the real controller says then: expired."""

    def __init__(self, retry_s: float, deadline: float) -> None:
        self.retry_s, self.deadline, self.asked = retry_s, deadline, 0

    def decide(self, *, now: float, **_) -> Decision:
        self.asked += 1
        if now >= self.deadline:
            return Decision("expired", "deadline", 504)
        return Decision("wait", "interactive-busy", 429, self.retry_s)


def held_state(controller: Busy) -> SimpleNamespace:
    return SimpleNamespace(cfg=SimpleNamespace(admission_control=True), admission=controller, draining=False,
                           held=0, metrics=GatewayMetrics(), directory=SimpleNamespace(signals=dict))


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
    assert state.held == 0 and state.metrics.held._value.get() == 0


async def test_a_draining_gateway_answers_what_it_holds_with_a_503() -> None:
    deadline = time.time() + 30
    controller = Busy(retry_s=0.01, deadline=deadline)
    state = held_state(controller)
    asyncio.get_running_loop().call_later(0.05, setattr, state, "draining", True)
    with pytest.raises(APIError) as refused:
        await admit(state, PARSED, "batch", deadline)
    assert refused.value.status == 503 and refused.value.code == "shutting_down"
    assert controller.asked >= 2 and decisions(state, "wait") == 1
    assert state.held == 0
