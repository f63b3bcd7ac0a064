"""Turn last-position logits into next tokens: greedy, temperature, top-k, top-p, per-request seed."""

import torch

from strata.server.engine.sequence import Sequence


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """One token per row of logits [S, vocab]; greedy rows never touch a random generator."""
    logits = logits.float()
    tokens = logits.argmax(dim=-1).tolist()
    sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if not sampled:
        return tokens
    rows = logits[sampled]
    temps = torch.tensor([seqs[i].params.temperature for i in sampled], device=rows.device)
    rows = rows / temps.unsqueeze(1)
    top_ks = [seqs[i].params.top_k for i in sampled]
    if any(top_ks):
        k = torch.tensor([kk or rows.shape[1] for kk in top_ks], device=rows.device)
        kth = rows.sort(dim=-1, descending=True).values.gather(1, (k - 1).unsqueeze(1))
        rows = rows.masked_fill(rows < kth, float("-inf"))
    top_ps = torch.tensor([seqs[i].params.top_p for i in sampled], device=rows.device)
    if (top_ps < 1.0).any():
        sorted_logits, order = rows.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative - sorted_logits.softmax(dim=-1) >= top_ps.unsqueeze(1)  # keep the token that crosses p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        rows = torch.full_like(rows, float("-inf")).scatter(1, order, sorted_logits)
    probs = rows.softmax(dim=-1).cpu()
    for row, i in enumerate(sampled):
        tokens[i] = int(torch.multinomial(probs[row], 1, generator=seqs[i].generator))
    return tokens
