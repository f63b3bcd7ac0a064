"""What drafting knows about one request: its counts, and how long its next draft may be (adaptive)."""

from dataclasses import dataclass, field

from strata.server.engine.spec.ngram import NgramIndex

MAX_BACKOFF_STEPS = 32      # a request whose drafts keep failing still tries again at least this often


@dataclass(slots=True)
class DraftStats:
    """Counts for one request or one draft source (headers and /metrics)."""

    drafts: int = 0             # verify steps that carried a draft
    proposed_tokens: int = 0
    accepted_tokens: int = 0    # draft tokens equal to what the model took
    steps_saved: int = 0        # accepted tokens that reached the output: each one is a decode step not run

    def add(self, other: "DraftStats") -> None:
        self.drafts += other.drafts
        self.proposed_tokens += other.proposed_tokens
        self.accepted_tokens += other.accepted_tokens
        self.steps_saved += other.steps_saved

    def as_dict(self) -> dict[str, int]:
        return {"drafts": self.drafts, "proposed_tokens": self.proposed_tokens,
                "accepted_tokens": self.accepted_tokens, "steps_saved": self.steps_saved}


@dataclass(slots=True)
class Acceptance:
    """Draft tokens that met the model, for one request or one source: the accepted ones, and the first rejected
    token of each draft cut short. hits / tries estimates the chance that the next draft token is accepted."""

    hits: int = 0
    tries: int = 0

    def add(self, proposed: int, accepted: int) -> None:
        self.hits += accepted
        self.tries += accepted + (accepted < proposed)


@dataclass(slots=True)
class DraftState:
    """Adaptive length: a verified step costs more than a plain one, so drafts that keep failing are made shorter,
    then paused for a number of steps that doubles with each miss; any accepted token resets the pause."""

    length: int = 0             # the next draft's most tokens; 0 = not set yet (the engine's maximum)
    misses: int = 0             # drafts in a row of which nothing was accepted
    pause: int = 0              # decode steps to run without a draft
    acceptance: Acceptance = field(default_factory=Acceptance)
    by_source: dict[str, DraftStats] = field(default_factory=dict)
    ngrams: NgramIndex = field(default_factory=NgramIndex)      # prompt lookup over the request's own tokens

    def count(self, source: str, one: DraftStats) -> None:
        self.by_source.setdefault(source, DraftStats()).add(one)

    def summary(self) -> dict[str, dict[str, int]] | None:
        """source -> counts, for the response (None when nothing was drafted)."""
        return {source: stats.as_dict() for source, stats in self.by_source.items()} or None

    def allowed(self, maximum: int) -> int:
        """Tokens the next draft may have (0: none this step)."""
        if self.pause > 0:
            self.pause -= 1
            return 0
        return min(self.length or maximum, maximum)

    def update(self, proposed: int, accepted: int, maximum: int) -> None:
        self.acceptance.add(proposed, accepted)
        if accepted == 0:
            self.misses += 1
            self.length = max(1, (self.length or maximum) // 2)
            self.pause = min(2 ** (self.misses - 1) - 1, MAX_BACKOFF_STEPS)
        else:
            self.misses, self.pause = 0, 0
            self.length = min(maximum, accepted + 2 if accepted < proposed else (self.length or maximum) + 2)
