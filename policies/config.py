"""The policy configuration: one typed tree, loaded from the dict the caller parsed out of YAML.

Validation happens once at start (a bad value stops the gateway with a message naming the key),
so the hot path reads plain attributes and never re-checks anything. Every field has a default,
so an empty file is a working configuration; ``policies/default.yaml`` documents the same values.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import msgspec

Class = Literal["interactive", "batch"]
CLASSES: tuple[Class, ...] = ("interactive", "batch")

PosFloat = Annotated[float, msgspec.Meta(gt=0, le=sys.float_info.max)]
"""Positive and finite: an infinite deadline or objective fails later, where it is used."""
PosInt = Annotated[int, msgspec.Meta(gt=0)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
Fraction = Annotated[float, msgspec.Meta(gt=0, lt=1)]
Growth = Annotated[float, msgspec.Meta(gt=1)]


class PolicyConfigError(ValueError):
    """A configuration value that cannot work; the message names the key."""


class _Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class InteractiveObjective(_Section, frozen=True):
    e2e_p99_s: PosFloat = 0.150
    """Objective for non-streamed answers: the whole response."""
    ttft_p99_s: PosFloat = 0.150
    """Objective for streamed answers: the first token."""
    deadline_s: PosFloat = 30.0
    """After this long nobody waits for an interactive answer; the worker drops it."""


class BatchObjective(_Section, frozen=True):
    max_queue: PosInt = 1000
    """Batch entries allowed to wait in a pool's stream; beyond it batch is shed."""
    deadline_s: PosFloat = 3600.0
    """Default time a batch request may spend queued and running before it fails."""
    hold_load: PosFloat = 0.8
    """Interactive load ((queued + waiting + running) / capacity) at which batch headed for a
    pool that interactive work may use is told to wait."""
    hold_retry_s: PosFloat = 1.0
    """How often the oldest held-back batch request asks again whether it may go."""
    max_held: PosInt = 1000
    """Batch requests one gateway holds back at once (each keeps its client's connection open);
    beyond it batch is shed as ``batch-queue-full``."""


class Objectives(_Section, frozen=True):
    interactive: InteractiveObjective = msgspec.field(default_factory=InteractiveObjective)
    batch: BatchObjective = msgspec.field(default_factory=BatchObjective)


class Heuristics(_Section, frozen=True):
    interactive_max_tokens: NonNegInt = 64
    batch_prompt_chars: PosInt = 8000
    batch_max_tokens: PosInt = 256

    def __post_init__(self) -> None:
        if self.interactive_max_tokens >= self.batch_max_tokens:
            raise ValueError("interactive_max_tokens must be below batch_max_tokens")


class Classification(_Section, frozen=True):
    key_classes: dict[str, Class] = {}
    """API key id -> the class its requests get unless they say otherwise."""
    model_routes: dict[str, Class] = {}
    """Model id -> class, for models that only make sense as one kind of work."""
    heuristics: Heuristics = msgspec.field(default_factory=Heuristics)
    default_class: Class = "batch"
    """For requests no rule recognises. Batch, because interactive capacity is what the
    objective protects and work that shows no sign of a waiting user should not spend it."""


class Estimator(_Section, frozen=True):
    alpha: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.1
    """EWMA weight of the newest finished request."""
    prefill_window: PosInt = 100
    prefill_quantile: Fraction = 0.1
    """Prefill cost per token is this quantile of the last ``prefill_window`` requests' samples.
    What a first token took beyond its measured queue wait includes time spent waiting inside
    a busy worker: load, not cost (the slot prediction accounts for it), and counted as cost it
    would shed the very requests that could run. A low quantile is the cost without the wait;
    a window lets it rise again when prefill really gets slower."""
    min_samples: NonNegInt = 5
    """Finished requests a pool needs before its learned costs replace the heartbeat's."""
    prior_prefill_s_per_token: PosFloat = 0.00005
    prior_decode_s_per_token: PosFloat = 0.005
    """Priors are optimistic on purpose: a pessimistic prior sheds everything, so nothing is
    ever admitted to learn from; the feedback loop corrects optimism instead."""
    prior_prompt_tokens: PosFloat = 256.0
    prior_completion_tokens: PosFloat = 64.0


class Feedback(_Section, frozen=True):
    samples: PosInt = 200
    """Measured interactive latencies per verdict (one that tightens comes as soon as more of
    them are late than ``quantile`` allows); the window restarts after each verdict, and only
    requests admitted under the current factor count."""
    quantile: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.99
    tighten: Growth = 1.25
    relax: Growth = 1.05
    """The smallest relaxing step; a quantile further under the headroom relaxes by up to
    ``headroom / quantile``, never by more than ``tighten``."""
    headroom: Fraction = 0.7
    """Relax only when the quantile is below this fraction of the objective."""
    min_factor: PosFloat = 0.5
    max_factor: PosFloat = 4.0

    def __post_init__(self) -> None:
        if not self.min_factor <= 1.0 <= self.max_factor:
            raise ValueError("need min_factor <= 1 <= max_factor")


class Admission(_Section, frozen=True):
    margin: Annotated[float, msgspec.Meta(ge=1)] = 1.2
    """Predictions are multiplied by this before they are compared with the objective."""
    min_retry_after_s: PosFloat = 0.05
    max_retry_after_s: PosFloat = 30.0
    unavailable_retry_after_s: PosFloat = 1.0
    queue_hold_factor: Annotated[float, msgspec.Meta(ge=0)] = 2.0
    """When no slot is free now, a request that would hold one longer than this many times
    the pool's mean is shed rather than queued: under overload the slots go to the answers
    that make the most on-time requests per slot-second. Long streams still get in whenever
    a slot is free without a queue. 0 turns this off."""
    probe_interval_s: PosFloat = 0.25
    """A pool that has been shedding and silent this long gets one request through, so its
    learned costs can recover once the overload passes."""
    estimator: Estimator = msgspec.field(default_factory=Estimator)
    feedback: Feedback = msgspec.field(default_factory=Feedback)

    def __post_init__(self) -> None:
        if self.min_retry_after_s > self.max_retry_after_s:
            raise ValueError("min_retry_after_s must not exceed max_retry_after_s")


PoolList = Annotated[list[str], msgspec.Meta(min_length=1)]


class Pools(_Section, frozen=True):
    """Class -> the pools that serve it first (the fastest predicted one wins)."""

    interactive: PoolList = msgspec.field(default_factory=lambda: ["interactive"])
    batch: PoolList = msgspec.field(default_factory=lambda: ["batch"])

    def __getitem__(self, cls: str) -> list[str]:
        return self.interactive if cls == "interactive" else self.batch


class Routing(_Section, frozen=True):
    pools: Pools = msgspec.field(default_factory=Pools)
    interactive_spill: list[str] = []
    """Pools interactive work may spill to when its own cannot meet the objective. Batch never
    spills into interactive pools: that capacity is what the objective protects."""


class Circuit(_Section, frozen=True):
    consecutive_failures: PosInt = 5
    failure_rate: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.5
    window: PosInt = 20
    """Latest outcomes over which failure_rate is measured."""
    min_calls: PosInt = 10
    """Outcomes needed in the window before the rate can open the circuit."""
    open_s: PosFloat = 5.0
    """Cool-down before an open circuit lets probes through."""
    half_open_probes: PosInt = 1
    """Probes allowed in flight at once while half-open, in engine requests: a request of ``n``
    choices is ``n`` probes, and one of more choices than this probes alone."""
    close_after: PosInt = 2
    """Successful probes that close the circuit again."""

    def __post_init__(self) -> None:
        if self.min_calls > self.window:
            raise ValueError("min_calls must not exceed window")


class KeyLimit(_Section, frozen=True):
    rpm: NonNegInt | None = None
    tpm: NonNegInt | None = None


class RateLimits(_Section, frozen=True):
    rpm: NonNegInt = 600
    """Requests per minute per API key; 0 means unlimited."""
    tpm: NonNegInt = 200_000
    """Tokens (prompt + max_tokens) per minute per API key; 0 means unlimited."""
    per_key: dict[str, KeyLimit] = {}

    def for_key(self, key_id: str) -> tuple[int, int]:
        """The (rpm, tpm) that apply to a key: its overrides, else the defaults."""
        own = self.per_key.get(key_id)
        if own is None:
            return self.rpm, self.tpm
        return (self.rpm if own.rpm is None else own.rpm, self.tpm if own.tpm is None else own.tpm)


class PolicyConfig(_Section, frozen=True):
    objectives: Objectives = msgspec.field(default_factory=Objectives)
    classification: Classification = msgspec.field(default_factory=Classification)
    admission: Admission = msgspec.field(default_factory=Admission)
    routing: Routing = msgspec.field(default_factory=Routing)
    circuit: Circuit = msgspec.field(default_factory=Circuit)
    rate_limits: RateLimits = msgspec.field(default_factory=RateLimits)


def load(data: Mapping[str, Any] | None, root: str = "policies") -> PolicyConfig:
    """Build and validate the config; ``root`` is how the caller's file names this section, so
    errors read ``policies.admission.margin: Expected `float` >= 1.0``."""
    try:
        return msgspec.convert({} if data is None else data, PolicyConfig)
    except msgspec.ValidationError as exc:
        message, _, where = str(exc).rpartition(" - at `")
        if not message:
            raise PolicyConfigError(f"{root}: {exc}") from None
        path = where.rstrip("`").replace("$", root, 1)
        raise PolicyConfigError(f"{path}: {message}") from None
