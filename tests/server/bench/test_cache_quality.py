"""The quality bench's pairwise protocol against hand-computed oracles: each pair decided alone, rates per tier, the
hindsight curve and AUC for the second stage and for cosine, and scores reused across bounds."""
import itertools

import numpy as np
import pytest

from strata.cache.request.calibration import COSINE_WEIGHT, Tiers
from strata.cache.request.embedders import HashEmbedder
from strata.cache.request.semantic import SemanticCache
from strata.server.bench.cache_quality import Seen, curve, pairwise
from strata.server.tuning.pairs import Pair

# (score the second stage gives, same intent): the cached text carries its index so the scorer can look it up
ROWS = [(3.0, True), (2.5, False), (2.2, True), (1.8, True), (1.5, False), (1.2, True), (0.9, True), (0.5, False),
        (0.2, False), (-1.0, True)]


class ScoreByIndex:
    """The logit that makes the decision score (logit + COSINE_WEIGHT * cosine) the row's score."""

    def __init__(self):
        self.calls = 0

    def score(self, cached, query):
        self.calls += 1
        a, b = HashEmbedder().encode([cached, query])
        return ROWS[int(cached.split()[-1])][0] - COSINE_WEIGHT * float(np.dot(a, b))


WORDS = "how do I move my old photos from one phone to another one safely".split()


def pairs():
    """The i-th query keeps i + 2 of the cached question's words: cosines far apart, in no order of the labels'."""
    return [Pair(" ".join([*WORDS, str(i)]), " ".join([*WORDS[:(7 * i) % len(ROWS) + 2], str(i)]), same, "en", "t")
            for i, (_, same) in enumerate(ROWS)]


def layer(scorer):
    return SemanticCache(HashEmbedder(), Tiers(serve=2.0, similar=1.0, floor=-1.0), scorer)


def best_hit_at(precision, scores, same):
    """Brute force: every threshold, the largest share of positives served at that precision or better."""
    best = 0.0
    for t in scores:
        served = scores >= t
        if same[served].mean() >= precision:
            best = max(best, same[served].sum() / same.sum())
    return best


def test_each_pair_is_decided_alone_and_rated_against_its_label():
    out = pairwise(layer(ScoreByIndex()), pairs())
    served = [s >= 1.0 for s, _ in ROWS]                       # similar tier from 1.0, serve tier from 2.0
    same = [y for _, y in ROWS]
    correct = sum(a and b for a, b in zip(served, same, strict=True))
    assert out["all"] == {"hit_rate": round(correct / sum(same), 4), "precision": round(correct / sum(served), 4),
                          "false_hit_rate": round((sum(served) - correct) / (len(ROWS) - sum(same)), 4),
                          "pairs": len(ROWS), "positives": sum(same), "served": sum(served)}
    assert out["by_tier"]["serve"]["served"] == 3 and out["by_tier"]["similar"]["served"] == 3
    assert out["en"] == out["all"] and "zh" not in out


def test_curve_and_auc_match_brute_force_for_the_score_and_for_cosine():
    out = pairwise(layer(ScoreByIndex()), pairs())
    scores, same = np.array([s for s, _ in ROWS]), np.array([y for _, y in ROWS])
    for q in (0.95, 0.97, 0.99):
        assert out["curve"]["en"][f"hit_at_precision_{q}"] == pytest.approx(best_hit_at(q, scores, same), abs=1e-4)
    assert out["curve"]["en"]["auc"] == pytest.approx(mann_whitney(scores, same), abs=1e-4)
    vectors = HashEmbedder().encode([t for p in pairs() for t in (p.cached, p.query)])
    cosines = np.array([float(np.dot(a, b)) for a, b in zip(vectors[0::2], vectors[1::2], strict=True)])
    assert out["cosine_curve"]["en"]["auc"] == pytest.approx(mann_whitney(cosines, same), abs=1e-4)
    assert out["cosine_curve"]["en"]["hit_at_precision_0.97"] == pytest.approx(best_hit_at(0.97, cosines, same), abs=1e-4)


def test_a_tie_is_served_whole_so_the_curve_does_not_depend_on_input_order():
    """Audit 16: a point inside a tie (which no threshold can separate) counted, so the same pairs in another order
    gave another hit rate at precision 0.95 (0.333 or 0)."""
    same = np.array([True, False, True, True])
    first, second = curve(same, np.array([1.0, 1.0, 0.5, 0.4])), curve(same[[1, 0, 2, 3]], np.array([1.0, 1.0, 0.5, 0.4]))
    assert first["hit_at_precision_0.95"] == second["hit_at_precision_0.95"] == 0.0


def mann_whitney(scores, same):
    """AUC as the share of (positive, negative) pairs ranked right, ties counting half."""
    return np.mean([(p > n) + 0.5 * (p == n) for p, n in itertools.product(scores[same], scores[~same])])


def test_a_second_bound_reuses_the_scores_and_embeddings():
    seen, scorer = Seen(), ScoreByIndex()
    first = pairwise(layer(scorer), pairs(), seen)
    calls = scorer.calls
    assert calls == len(ROWS) and len(seen.vectors) == 2 * len(ROWS)
    strict = SemanticCache(HashEmbedder(), Tiers(serve=2.8, similar=2.8, floor=-1.0), scorer)
    second = pairwise(strict, pairs(), seen)
    assert scorer.calls == calls                                 # nothing scored twice
    assert second["all"]["served"] == 1 < first["all"]["served"] and second["curve"] == first["curve"]
