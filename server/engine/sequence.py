"""One request's tokens, its block table and its progress through prefill and decode."""

import enum
import time
from dataclasses import dataclass, field

import torch

from strata.server.engine.logprobs import TokenLogprob
from strata.server.engine.sampling_params import SamplingParams
from strata.server.engine.spec.state import DraftState


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """Everything the scheduler and runner track per request; token_ids holds prompt then output. Two sequences
    are equal only when they are the same object (the scheduler keeps them in sets and lists)."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    num_prompt_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0     # prompt tokens found in the prefix cache when first admitted (usage reports it)
    admitted: bool = False         # admitted once: a recompute after a preemption leaves num_cached_tokens as it was
    block_hashes: list[int] = field(default_factory=list)   # prefix-cache chain hashes of its full blocks
    num_hashed_blocks: int = 0
    swap_slots: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None      # why it failed (finish_reason "error")
    output_text: str = ""
    num_released_chars: int = 0   # of output_text, streamed out already (the rest may still be cut by a stop string)
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    generator: torch.Generator | None = None
    # with params.prompt_logprobs: one TokenLogprob per prompt token (the first has no logprob: nothing precedes it),
    # None until its prefill ran; filled by position, so a prefill run again after a preemption changes nothing
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # speculative decoding: the tokens proposed for the next step (never part of token_ids until verified), the
    # source that proposed them, candidate answers a draft may come from (--speculative cache) and what it got
    draft_token_ids: list[int] = field(default_factory=list)
    draft_source: str | None = None
    draft_candidates: list[list[int]] = field(default_factory=list)
    spec: DraftState = field(default_factory=DraftState)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = self.num_prompt_tokens or len(self.token_ids)
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [TokenLogprob(self.token_ids[0], None)] + [None] * (self.num_prompt_tokens - 1)
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
