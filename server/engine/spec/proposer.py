"""Draft sources: prompt lookup over the sequence itself (ngram) and the answers of close cached questions (cache).

Each step the proposer gives every sequence about to be sampled a draft, at most as long as its adaptive length
allows and never longer than the tokens it may still produce; the scheduler keeps of it what pays for its row
(policy "cost") or all the step's budget allows ("always"); the engine verifies it and reports back here.
"""

from collections.abc import Iterable

from strata.server.engine.sequence import Sequence
from strata.server.engine.spec.cost import StepCost
from strata.server.engine.spec.ngram import continuation
from strata.server.engine.spec.state import Acceptance, DraftStats

PRIOR_TRIES = 2         # a request's own acceptance outweighs its source's after this many verified tokens


class DraftProposer:
    def __init__(self, sources: tuple[str, ...], num_tokens: int, max_model_len: int, policy: str = "cost"):
        """policy: EngineConfig.speculative_policy (validated there), "cost" or "always"."""
        self.sources = sources
        self.num_tokens = num_tokens
        self.max_model_len = max_model_len
        self.policy = policy
        self.cost = StepCost()
        self.totals = {source: DraftStats() for source in sources}
        self.accepted = {source: Acceptance() for source in sources}

    def propose(self, seqs: Iterable[Sequence]) -> None:
        """Set the draft of each sequence that will be sampled next: decode-ready ones, and ones without output
        yet that carry cached answers (their draft goes with the prompt's last chunk)."""
        for seq in seqs:
            seq.draft_token_ids, seq.draft_source = [], None
            if seq.num_uncomputed_tokens == 1 or (seq.draft_candidates and not seq.num_output_tokens):
                seq.draft_token_ids, seq.draft_source = self._draft(seq)

    def _draft(self, seq: Sequence) -> tuple[list[int], str | None]:
        # a verify step yields one token past its accepted draft: the draft leaves room for it
        room = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - len(seq.token_ids)) - 1
        if room <= 0:
            return [], None
        k = min(seq.spec.allowed(self.num_tokens), room)
        best: tuple[list[int], str | None] = ([], None)
        if k and "cache" in self.sources and seq.draft_candidates:
            best = (self._from_answers(seq, k), "cache")
        if k and "ngram" in self.sources and len(best[0]) < k:
            found = seq.spec.ngrams.continuation(seq.token_ids, k)
            if len(found) > len(best[0]):
                best = (found, "ngram")
        return best if best[0] else ([], None)

    @staticmethod
    def _from_answers(seq: Sequence, k: int) -> list[int]:
        """The first cached answer the output so far starts like, at the same place; else the latest n-gram match
        of the output's tail in any of them."""
        output = seq.output_token_ids
        for answer in seq.draft_candidates:
            if answer[:len(output)] == output and len(answer) > len(output):
                return answer[len(output):len(output) + k]
        tail = seq.token_ids[-8:]
        for answer in seq.draft_candidates:
            if found := continuation(answer, tail, k):
                return found
        return []

    def keep_paying(self, seqs: list[Sequence], rows: int) -> None:
        """Cut the drafts of a step's sampled sequences to the tokens worth verifying, for a step of `rows` tokens
        before drafts (policy "cost"; "always" keeps them)."""
        drafted = [seq for seq in seqs if seq.draft_token_ids]
        if self.policy == "always" or not drafted:
            return
        kept = self.cost.keep(rows, len(seqs), [(self.acceptance(seq), len(seq.draft_token_ids)) for seq in drafted])
        for seq, n in zip(drafted, kept, strict=True):
            del seq.draft_token_ids[n:]

    def acceptance(self, seq: Sequence) -> float:
        """Chance that the next draft token of this sequence is accepted: its own record, starting from its source's
        (which starts at 1, so that every source is tried)."""
        source, own = self.accepted[seq.draft_source], seq.spec.acceptance
        prior = (source.hits + 1) / (source.tries + 1)
        return (own.hits + PRIOR_TRIES * prior) / (own.tries + PRIOR_TRIES)

    def record(self, seq: Sequence, proposed: int, accepted: int, saved: int) -> None:
        """One verified draft: adapt the sequence's next draft length and count it for it and its source."""
        seq.spec.update(proposed, accepted, self.num_tokens)
        self.accepted[seq.draft_source].add(proposed, accepted)
        one = DraftStats(1, proposed, accepted, saved)
        seq.spec.count(seq.draft_source, one)
        self.totals[seq.draft_source].add(one)

    def stats(self) -> dict[str, int]:
        """Flat per-source counters for engine stats (spec_<source>_<counter>)."""
        return {f"spec_{source}_{name}": value for source, totals in self.totals.items()
                for name, value in totals.as_dict().items()}
