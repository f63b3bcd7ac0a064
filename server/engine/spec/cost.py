"""Which draft tokens are worth a row in this step. A verify row costs step time whether or not it is accepted: at
batch 1 a step is mostly fixed overhead and almost any draft pays, at batch 16 on a CPU each row costs nearly as
much as a whole sequence's decode and only drafts likely to be accepted do. The engine times its decode steps and
a line fitted to (rows, seconds) prices one more row.
"""

from dataclasses import dataclass

MIN_SPREAD = 0.5        # rows' variance below which the slope is not re-fitted (all steps the same size)
EXPLORE_EVERY = 3       # once steps keep coming in one size with the price unknown, every third verifies no draft:
ONE_SIZE_STEPS = 4      # a step-token cap that every step fills would otherwise keep the price unknown for good


@dataclass(slots=True)
class StepCost:
    """Seconds of a decode step as fixed + per_row * rows, fitted to recent steps with exponential forgetting.
    Until steps of different sizes have been seen the per-row cost is unknown (None) and every draft is kept; once
    ONE_SIZE_STEPS observed steps had one size, every EXPLORE_EVERY-th step verifies none so that sizes differ."""

    decay: float = 0.97
    fixed: float = 0.0
    per_row: float | None = None
    _w: float = 0.0
    _x: float = 0.0
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0
    _one_size_steps: int = 0    # steps observed while the price was unknown (all of one size, or it would be known)
    _unpriced_keeps: int = 0

    def observe(self, rows: int, seconds: float) -> None:
        d = self.decay
        self._w = d * self._w + 1.0
        self._x = d * self._x + rows
        self._y = d * self._y + seconds
        self._xx = d * self._xx + rows * rows
        self._xy = d * self._xy + rows * seconds
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mean_x * mean_x
        if var >= MIN_SPREAD:           # else keep the last slope: a steady batch says nothing new about it
            self.per_row = max(0.0, (self._xy / self._w - mean_x * mean_y) / var)
        elif self.per_row is None:
            self._one_size_steps += 1
        if self.per_row is not None:
            self.fixed = max(0.0, mean_y - self.per_row * mean_x)

    def keep(self, rows: int, sampled: int, drafts: list[tuple[float, int]]) -> list[int]:
        """How many tokens of each draft to verify. `rows` the step has without drafts, `sampled` the sequences it
        samples (each yields a token anyway), drafts as (per-token acceptance, length). Token j of a draft is
        accepted with probability acceptance**j; tokens are taken most likely first while each raises the expected
        tokens per second of the step: p * (fixed + per_row * rows) > per_row * expected tokens."""
        if self.per_row is None:
            self._unpriced_keeps += 1
            explore = self._one_size_steps >= ONE_SIZE_STEPS and self._unpriced_keeps % EXPLORE_EVERY == 0
            return [0 if explore else n for _, n in drafts]
        candidates = sorted(((alpha ** j, i) for i, (alpha, n) in enumerate(drafts) for j in range(1, n + 1)),
                            reverse=True)
        kept, expected = [0] * len(drafts), float(sampled)
        for p, i in candidates:
            if p * (self.fixed + self.per_row * rows) <= self.per_row * expected:
                break
            kept[i] += 1
            rows += 1
            expected += p
        return kept
