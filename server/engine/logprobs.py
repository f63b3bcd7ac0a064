"""Log-probabilities of the sampled tokens, for requests that ask for them (OpenAI's `logprobs`).

They are the log-softmax of the model's raw fp32 logits at that position: before penalties, min_tokens, temperature,
top-k and top-p (vLLM's default "raw" mode), so they describe the model, not the sampling settings. Only the rows
that asked are computed, in one batched log-softmax, with their top alternatives from one torch.topk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:       # sequence.py imports TokenLogprob from here
    from strata.server.engine.sequence import Sequence


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    """One position: the token taken, its logprob, and the `top` most likely tokens as (token id, logprob)."""

    token_id: int
    logprob: float | None           # None only for a prompt's first token
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, seqs: list[Sequence], tokens: list) -> list[TokenLogprob | None]:
    """For each row of logits [S, vocab], the logprob of its token in `tokens` when its sequence asked (None
    otherwise, and for a row whose token is not an int: it failed sampling)."""
    rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None and isinstance(tokens[i], int)]
    out: list[TokenLogprob | None] = [None] * len(seqs)
    if not rows:
        return out
    index = torch.tensor(rows, device=logits.device)
    entries = _entries(logits.index_select(0, index), [tokens[i] for i in rows],
                       [seqs[i].params.logprobs for i in rows])
    for i, entry in zip(rows, entries, strict=True):
        out[i] = entry
    return out


def fill_prompt_logprobs(logits: torch.Tensor, seq: Sequence, start: int) -> None:
    """Prompt logprobs from one prefill chunk: logits [n, vocab] of positions start.. predict the tokens after
    them; those still in the prompt are written into seq.prompt_logprobs (the last position's token is sampled)."""
    targets = seq.token_ids[start + 1:min(start + logits.shape[0], seq.num_prompt_tokens - 1) + 1]
    if not targets:
        return
    entries = _entries(logits[:len(targets)], targets, [seq.params.prompt_logprobs] * len(targets))
    seq.prompt_logprobs[start + 1:start + 1 + len(entries)] = entries


def _entries(logits: torch.Tensor, tokens: list[int], wants: list[int]) -> list[TokenLogprob]:
    """Row r: the logprob of tokens[r] and the wants[r] most likely tokens, from one log-softmax and one topk."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, torch.tensor(tokens, device=logp.device).unsqueeze(1)).squeeze(1).tolist()
    k = max(wants)
    top_values, top_ids = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    return [TokenLogprob(token, value, tuple(zip(ids[:want], values[:want], strict=True)))
            for token, value, ids, values, want in zip(tokens, chosen, top_ids, top_values, wants, strict=True)]
