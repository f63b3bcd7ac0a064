"""Log-probabilities of the sampled tokens, for requests that ask for them (OpenAI's `logprobs`).

They are the log-softmax of the model's raw fp32 logits at that position: before penalties, min_tokens, temperature,
top-k and top-p (vLLM's default "raw" mode), so they describe the model, not the sampling settings. Only the rows
that asked are computed, in one batched log-softmax, with their top alternatives from one torch.topk.
"""

from dataclasses import dataclass

import torch

from strata.server.engine.sequence import Sequence


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    """One position: the token taken, its logprob, and the `top` most likely tokens as (token id, logprob)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, seqs: list[Sequence], tokens: list) -> list[TokenLogprob | None]:
    """For each row of logits [S, vocab], the logprob of its token in `tokens` when its sequence asked (None
    otherwise, and for a row whose token is not an int: it failed sampling)."""
    rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None and isinstance(tokens[i], int)]
    out: list[TokenLogprob | None] = [None] * len(seqs)
    if not rows:
        return out
    index = torch.tensor(rows, device=logits.device)
    logp = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
    chosen = logp.gather(1, torch.tensor([[tokens[i]] for i in rows], device=logp.device)).squeeze(1).tolist()
    k = max(seqs[i].params.logprobs for i in rows)
    top_values, top_ids = (logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long()))
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    for row, i in enumerate(rows):
        want = seqs[i].params.logprobs
        out[i] = TokenLogprob(tokens[i], chosen[row], tuple(zip(top_ids[row][:want], top_values[row][:want],
                                                                       strict=True)))
    return out
