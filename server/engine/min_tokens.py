"""min_tokens as vLLM has it: a sequence cannot end (EOS, stop_token_ids) before it has that many output tokens."""

import torch

from strata.server.engine.sequence import Sequence


def suppress_early_stops(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: frozenset[int]) -> torch.Tensor:
    """Logits with EOS (unless ignore_eos) and stop_token_ids at -inf for rows still short of min_tokens."""
    rows, cols = [], []
    for i, s in enumerate(seqs):
        if s.num_output_tokens < s.params.min_tokens:
            ids = set(s.params.stop_token_ids) | (set() if s.params.ignore_eos else eos_token_ids)
            rows += [i] * len(ids)
            cols += sorted(ids)
    if not rows:
        return logits
    out = logits.clone()
    out[torch.tensor(rows), torch.tensor(cols)] = float("-inf")
    return out
