"""One request as the paged engine sees it: its tokens, how many of them already have keys
and values in the cache, and which cache blocks hold them.

The scheduler, the block manager and the model runner all read this one record, so none of
them needs to know about the others.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum, auto

from slogate.protocol import SamplingParams

_arrivals = itertools.count()


class Status(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]
    sampling: SamplingParams
    deadline: float = float("inf")
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    """Tokens whose keys and values are in the cache (computed or found in the prefix cache)."""
    num_cached_tokens: int = 0
    """Of the computed tokens, how many the prefix cache supplied at the last admission."""
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    """Chained hashes of the full blocks of ``token_ids``, filled lazily and kept across
    preemptions (the tokens they cover never change)."""
    status: Status = Status.WAITING
    num_preemptions: int = 0
    arrival: int = field(default_factory=lambda: next(_arrivals))

    def __post_init__(self) -> None:
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def max_total_tokens(self) -> int:
        """The length this sequence may reach, which is what must fit in context and pool."""
        return self.num_prompt_tokens + self.sampling.max_tokens

    @property
    def priority(self) -> tuple[float, int]:
        """Smaller is more urgent: earliest deadline first, then first come first served."""
        return (self.deadline, self.arrival)

    @property
    def is_prefilling(self) -> bool:
        """Whether more than the newest token still lacks keys and values."""
        return self.num_computed_tokens < len(self.token_ids) - 1

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
