"""The engine loop (:func:`engines.stepping.step_until_stopped`) with commands that arrive while
a step runs: an add reaches the engine during the step, when the engine asks; a cancel and the
stop wait for the step's end; what the engine sends during a step is reported at once. The
engine here is a recorder (what the loop does is the subject)."""

from __future__ import annotations

from collections import deque

import pytest

from engines.base import EngineLoad, EngineRequest, StepOutput
from engines.stepping import Report, Step, step_until_stopped
from slogate.protocol import SamplingParams


class Recorder:
    """Serves each request one token per step for ``tokens`` steps; logs every call."""

    name, model_id, max_context = "recorder", "m", 64

    def __init__(self, during_first_step: list[tuple]) -> None:
        self.log: list[str] = []
        self.live: dict[str, int] = {}
        self.in_step = False
        self.during_first_step = during_first_step
        self.inbox: deque[tuple] = deque()

    def add_request(self, request: EngineRequest) -> None:
        if request.id in self.live:  # as the engines take it: a redelivery of a request held here
            self.log.append(f"add {request.id} ignored")
            return
        self.log.append(f"add {request.id}{' in step' if self.in_step else ''}")
        self.live[request.id] = 3

    def abort_request(self, request_id: str) -> None:
        self.log.append(f"abort {request_id}{' in step' if self.in_step else ''}")
        self.live.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.live)

    def step(self, arrivals=None, send=None) -> list[StepOutput]:
        self.in_step = True
        if self.during_first_step:
            self.inbox.extend(self.during_first_step)
            self.during_first_step = []
            self.log.append(f"arrivals {arrivals()}")
            self.log.append(f"arrivals {arrivals()}")
        outputs = []
        for rid in list(self.live):
            self.live[rid] -= 1
            done = self.live[rid] == 0
            outputs.append(StepOutput(rid, "x", [1], "length" if done else None))
            if done:
                del self.live[rid]
        self.in_step = False
        self.log.append("step " + ",".join(o.request_id for o in outputs))
        return outputs

    def load(self) -> EngineLoad:
        return EngineLoad(running=len(self.live), waiting=0, capacity=4)


def request(rid: str) -> EngineRequest:
    return EngineRequest(rid, SamplingParams(max_tokens=3), deadline=1e12, prompt="p")


def test_adds_reach_the_engine_during_a_step_and_cancels_and_stop_wait_for_its_end():
    engine = Recorder(during_first_step=[("add", request("b")), ("abort", "a"), ("add", request("c")), ("stop",)])
    engine.inbox.append(("add", request("a")))
    reports: list[Report] = []

    def next_command(wait: bool):
        return engine.inbox.popleft() if engine.inbox else None

    step_until_stopped(engine, next_command, reports.append)

    assert engine.log[:5] == ["add a", "add b in step", "add c in step", "arrivals True", "arrivals False"]
    assert engine.log[5:8] == ["step a,b,c", "abort a", "step b,c"]
    assert engine.log[8:] == ["step b,c"], "the stop lets what is held finish"
    steps = [r for r in reports if isinstance(r, Step)]
    assert [[o.request_id for o in s.outputs] for s in steps] == [["a", "b", "c"], ["b", "c"], ["b", "c"]]


def test_a_request_cancelled_and_sent_again_during_a_step_is_served_again_after_it():
    """The add reached the engine during the step, ahead of the cancel before it: the engine,
    still holding the request, took it for a redelivery and ignored it, and the cancel then
    dropped the request, which was never served again."""
    engine = Recorder(during_first_step=[("abort", "a"), ("add", request("a")), ("stop",)])
    engine.inbox.append(("add", request("a")))
    reports: list[Report] = []

    def next_command(wait: bool):
        return engine.inbox.popleft() if engine.inbox else None

    step_until_stopped(engine, next_command, reports.append)
    assert engine.log[:6] == ["add a", "arrivals False", "arrivals False", "step a", "abort a", "add a"]
    outputs = [o for r in reports if isinstance(r, Step) for o in r.outputs]
    assert [o.finish_reason for o in outputs] == [None, None, None, "length"]


class WorkerGone(Exception):
    pass


def test_a_command_source_that_ends_during_a_step_ends_the_loop_after_it_not_as_its_failure():
    engine = Recorder(during_first_step=[("gone",)])
    engine.inbox.append(("add", request("a")))
    reports: list[Report] = []

    def next_command(wait: bool):
        if engine.inbox and engine.inbox[0] == ("gone",):
            raise WorkerGone
        return engine.inbox.popleft() if engine.inbox else None

    with pytest.raises(WorkerGone):
        step_until_stopped(engine, next_command, reports.append)
    assert engine.log == ["add a", "arrivals False", "arrivals False", "step a"]
    assert [type(r) for r in reports] == [Step]


class SendsNewcomersFirst(Recorder):
    """Serves a request that arrives during a step with one token at once, through ``send``,
    then fails the step."""

    def step(self, arrivals=None, send=None) -> list[StepOutput]:
        self.in_step = True
        self.inbox.append(("add", request("late")))
        arrivals()
        send([StepOutput("late", "x", [1], "length")])
        del self.live["late"]
        self.log.append("sent late")
        raise RuntimeError("out of memory (simulated)")


def test_outputs_sent_during_a_step_are_reported_before_it_ends_and_count_as_delivered():
    engine = SendsNewcomersFirst(during_first_step=[])
    engine.inbox.extend([("add", request("a")), ("stop",)])
    reports: list[Report] = []

    def next_command(wait: bool):
        return engine.inbox.popleft() if engine.inbox else None

    def report(r: Report) -> None:
        reports.append(r)
        engine.log.append(f"report {type(r).__name__}")

    step_until_stopped(engine, next_command, report)
    assert engine.log[:4] == ["add a", "add late in step", "report Step", "sent late"]
    assert [o.request_id for o in reports[0].outputs] == ["late"]
    assert reports[1].request_ids == {"a"}, "late finished in what was sent: the failed step does not fail it"


class FailsAfterSending(Recorder):
    """Sends an output of the request it holds, then fails the step."""

    def step(self, arrivals=None, send=None) -> list[StepOutput]:
        send([StepOutput("a", "x", [1])])
        raise RuntimeError("out of memory (simulated)")

    def load(self) -> EngineLoad:
        return EngineLoad(running=len(self.live), waiting=0, capacity=4, kv_usage=0.5 if self.live else 0.0)


def test_an_engine_that_a_failed_step_left_holding_nothing_reports_its_load_as_idle():
    """The worker's view of an engine process's load comes from its reports: the last one
    before a failure said it ran a request, and a failure says nothing of load. Without an
    idle report after it, the worker's heartbeats went on showing that request for as long as
    no new one came."""
    engine = FailsAfterSending(during_first_step=[])
    engine.inbox.append(("add", request("a")))
    reports: list[Report] = []

    def next_command(wait: bool):
        if wait and not engine.inbox:
            raise WorkerGone
        return engine.inbox.popleft() if engine.inbox else None

    with pytest.raises(WorkerGone):
        step_until_stopped(engine, next_command, reports.append)
    assert [type(r).__name__ for r in reports] == ["Step", "Failure", "Idle"]
    assert reports[0].load.running == 1
    assert reports[-1].load.running == 0 and reports[-1].load.kv_usage == 0.0


class SendsDuringItsStep(Recorder):
    """Hands an output on while its step runs, as the stream engine does."""

    def step(self, arrivals=None, send=None) -> list[StepOutput]:
        send([StepOutput("a", "x", [1])])
        return []


def test_a_worker_gone_while_a_step_hands_outputs_on_ends_the_loop_not_as_the_steps_failure(caplog):
    """The worker closes an engine process's socket when it stops with work held; the step
    then in progress cannot report. That is the worker's end, for which the process exits
    quietly, not the engine failing its requests with an error and a traceback in the log."""
    engine = SendsDuringItsStep(during_first_step=[])
    engine.inbox.append(("add", request("a")))

    def next_command(wait: bool):
        return engine.inbox.popleft() if engine.inbox else None

    def report(r: Report) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    with pytest.raises(BrokenPipeError):
        step_until_stopped(engine, next_command, report)
    assert "engine step failed" not in caplog.text
    assert "abort a" not in engine.log, "nothing is failed: the worker that held it is gone"
