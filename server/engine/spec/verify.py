"""Verifying drafts: the model's distribution at every draft position decides how much of a draft to keep.

Greedy: keep draft tokens while each equals the argmax; at the first mismatch (or after the last draft token) take
the model's own token, so a verify step always yields at least one token and exactly the tokens plain decoding would.
Sampling: speculative sampling with the draft as a deterministic proposal q = one-hot(x): accept x with probability
min(1, p(x) / q(x)) = p(x), else sample from the residual (p - q)+, which is p with x removed and renormalised.
Each kept token is then distributed exactly as p (Leviathan et al. 2023, Chen et al. 2023); p is what plain
sampling draws from, after penalties, min_tokens, temperature, top-k and top-p.
"""

import torch

from strata.server.engine.logprobs import TokenLogprob, token_logprobs
from strata.server.engine.sampler import RowError, distributions
from strata.server.engine.sequence import Sequence


class DraftRow:
    """Row j of a drafted sequence as the sampler sees it: the sequence followed by its first j draft tokens, so
    penalties and min_tokens treat it as plain decoding treats the sequence once those tokens are its own."""

    __slots__ = ("seq", "j")

    def __init__(self, seq: Sequence, j: int):
        self.seq, self.j = seq, j

    @property
    def params(self):
        return self.seq.params

    @property
    def generator(self) -> torch.Generator | None:
        return self.seq.generator

    @property
    def request_id(self) -> str:
        return self.seq.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return self.seq.num_prompt_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids + self.seq.draft_token_ids[:self.j]

    @property
    def output_token_ids(self) -> list[int]:
        return self.seq.output_token_ids + self.seq.draft_token_ids[:self.j]

    @property
    def num_output_tokens(self) -> int:
        return self.seq.num_output_tokens + self.j


def draft_rows(seqs: list[Sequence]) -> list[DraftRow]:
    """One row per sampled position: 1 + len(draft) per sequence, in order."""
    return [DraftRow(seq, j) for seq in seqs for j in range(1 + len(seq.draft_token_ids))]


def verify(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: frozenset[int] = frozenset()
           ) -> list[list[int] | RowError]:
    """The new tokens of each sequence (its accepted draft tokens, then one of the model's own) from logits
    [sum(1 + len(draft)), vocab], or a RowError when a row it reached could not be sampled."""
    tokens, probs, sampled = distributions(logits, draft_rows(seqs), eos_token_ids)
    prob_row = {i: r for r, i in enumerate(sampled)}
    out: list[list[int] | RowError] = []
    start = 0
    for seq in seqs:
        draft = seq.draft_token_ids
        out.append(_accept(seq, draft, tokens[start:start + len(draft) + 1],
                           [probs[prob_row[i]] if i in prob_row else None
                            for i in range(start, start + len(draft) + 1)]))
        start += len(draft) + 1
    return out


def _accept(seq: Sequence, draft: list[int], argmax: list, probs: list[torch.Tensor | None]
            ) -> list[int] | RowError:
    """argmax[j], probs[j]: row j's greedy token (or RowError) and, for a sampling request, its distribution."""
    for j, proposed in enumerate(draft):
        top, p = argmax[j], probs[j]
        if isinstance(top, RowError):
            return top
        if p is None:
            if top != proposed:
                return draft[:j] + [top]
        elif torch.rand(1, generator=seq.generator).item() >= p[proposed]:
            residual = p.clone()
            residual[proposed] = 0.0        # multinomial renormalises it
            return draft[:j] + [int(torch.multinomial(residual, 1, generator=seq.generator))]
    last, p = argmax[len(draft)], probs[len(draft)]
    if isinstance(last, RowError):
        return last
    return draft + [last if p is None else int(torch.multinomial(p, 1, generator=seq.generator))]


def draft_logprobs(logits: torch.Tensor, seqs: list[Sequence], new_tokens: list[list[int] | RowError]
                   ) -> list[list[TokenLogprob | None]]:
    """Per sequence, the logprob of each new token (from the row that produced it) when the request asked."""
    rows = draft_rows(seqs)
    taken: list[int | None] = []
    for seq, new in zip(seqs, new_tokens, strict=True):
        reached = [] if isinstance(new, RowError) else new
        taken += reached + [None] * (1 + len(seq.draft_token_ids) - len(reached))
    flat = token_logprobs(logits, rows, taken)
    out, start = [], 0
    for seq, new in zip(seqs, new_tokens, strict=True):
        out.append(flat[start:start + (1 if isinstance(new, RowError) else len(new))])
        start += 1 + len(seq.draft_token_ids)
    return out
