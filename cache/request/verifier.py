"""Second stage of a semantic lookup: the contrast guard vetoes hard conflicts, then a logistic regression over
contrast features says "same question?"."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from .contrast import FEATURES, Contrast, contrast

WEIGHTS_PATH = Path(__file__).with_name("data") / "verifier_weights.json"


@dataclass(slots=True)
class Verifier:
    """Standardise features, dot with fitted weights, squash: plain numpy-free inference from a small JSON."""

    embedder: str
    mean: list[float]
    scale: list[float]
    coef: list[float]
    intercept: float

    @classmethod
    def load(cls, embedder: str, path: Path = WEIGHTS_PATH) -> Verifier:
        """Weights fitted for this embedder by benchmarks/train_verifier.py (cosine scales differ per embedder)."""
        models = json.loads(Path(path).read_text(encoding="utf-8"))
        if models.get("features") != list(FEATURES):
            raise ValueError(f"{path} was fitted on features {models.get('features')}, code has {list(FEATURES)}; retrain")
        if embedder not in models["embedders"]:
            raise KeyError(f"no verifier weights for embedder {embedder!r} in {path} (have {sorted(models['embedders'])})")
        m = models["embedders"][embedder]
        return cls(embedder, m["mean"], m["scale"], m["coef"], m["intercept"])

    def probability(self, values: list[float]) -> float:
        """P(same question) from one pair's contrast feature values (FEATURES order)."""
        z = self.intercept + sum(c * (v - m) / s for c, v, m, s in zip(self.coef, values, self.mean, self.scale, strict=True))
        return 1.0 / (1.0 + math.exp(-max(min(z, 50.0), -50.0)))

    def judge(self, pair: Contrast) -> float:
        """The contrast guard, then the model: 0 on a hard conflict (numbers, antonyms, direction, time), else P(same)."""
        return 0.0 if pair.conflict else self.probability(pair.values)

    def score(self, query: str, cached: str, cosine: float) -> float:
        """Guarded P(same question) for a query and a cached question found at this cosine."""
        return self.judge(contrast(query, cached, cosine))
