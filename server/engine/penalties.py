"""Repetition, presence and frequency penalties (vLLM's and OpenAI's definitions), applied to raw logits before
temperature and top-k/top-p, one batched pass for every penalized row of a step."""

import torch

from strata.server.engine.sampling_params import MIN_TEMPERATURE
from strata.server.engine.sequence import Sequence


def _token_counts(id_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] occurrences of each token id per row; ragged lists padded into a spare column dropped after."""
    width = max((len(ids) for ids in id_lists), default=0)
    padded = torch.full((len(id_lists), max(width, 1)), vocab, dtype=torch.long)
    for row, ids in enumerate(id_lists):
        padded[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
    counts = torch.zeros(len(id_lists), vocab + 1, device=device)
    counts.scatter_add_(1, padded.to(device), torch.ones(padded.shape, device=device))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Penalized fp32 logits [S, vocab]. repetition_penalty r divides positive logits and multiplies negative ones
    of tokens seen in prompt or output; then presence p and frequency f subtract p * [seen in output] and
    f * count in output. Results are bounded so that even the smallest temperature cannot overflow them (a tiny r
    would otherwise turn a row's probabilities into NaN)."""
    rows = [i for i, s in enumerate(seqs) if s.params.penalized]
    if not rows:
        return logits
    vocab, device = logits.shape[1], logits.device
    picked = [seqs[i] for i in rows]
    output = _token_counts([s.output_token_ids for s in picked], vocab, device)
    prompt_seen = _token_counts([s.token_ids[:s.num_prompt_tokens] for s in picked], vocab, device) > 0

    def param(name: str) -> torch.Tensor:
        return torch.tensor([getattr(s.params, name) for s in picked], device=device).unsqueeze(1)

    x = logits[rows]
    r = param("repetition_penalty")
    x = torch.where(prompt_seen | (output > 0), torch.where(x > 0, x / r, x * r), x)
    x = x - param("frequency_penalty") * output - param("presence_penalty") * (output > 0)
    bound = torch.finfo(x.dtype).max * MIN_TEMPERATURE / 4      # / 4: room for rounding
    out = logits.clone()
    out[rows] = x.clamp(-bound, bound)
    return out

