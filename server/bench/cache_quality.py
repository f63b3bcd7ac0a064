"""`strata bench cache-quality`: precision and hit rate of the semantic cache on labelled question pairs.

Two protocols (the shared datasets' README.md):
- full cache: fill an empty cache with every distinct cached question (its answer is its own id), ask every query;
  a hit on the pair's own question when same=true is correct, any other hit is false, no hit is a miss;
- pairwise: each pair alone (its cached question is the only candidate), which measures the serve/don't-serve
  decision itself: precision, hit rate on positives and false-hit rate on negatives, per language and tier, plus
  the best hit rate any threshold on the same score would reach at precision 0.95 / 0.97 / 0.99 (hindsight).
"""
from __future__ import annotations

import asyncio
import math
import os
import platform
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from sklearn.metrics import roc_auc_score

from strata.cache.request.calibration import LANGUAGES, TierTable, decision_score
from strata.cache.request.config import RequestCacheConfig
from strata.cache.request.semantic import SemanticCache, SemanticMatch
from strata.server.bench.data_files import datasets_dir
from strata.server.tuning.pairs import Pair, jsonl_rows, load_pairs, shared_split

PARTITION = "bench"
CURVE_PRECISIONS = (0.95, 0.97, 0.99)


def fill(cache: SemanticCache, pairs: list[Pair], batch: int = 64) -> dict[str, np.ndarray]:
    """Add every distinct cached question (id = its text) and return the query embeddings."""
    vectors = fill_vectors(cache, pairs, batch)
    for text in dict.fromkeys(p.cached for p in pairs):
        cache.add(text, text, PARTITION, vectors[text])
    return {p.query: vectors[p.query] for p in pairs}


def _rates(rows: list[tuple[Pair, SemanticMatch | None]]) -> dict:
    pos = [(p, m) for p, m in rows if p.same]
    neg = [(p, m) for p, m in rows if not p.same]
    hits = [(p, m) for p, m in rows if m is not None]
    correct = sum(p.same and m.entry_id == p.cached for p, m in hits)
    return {
        "pairs": len(rows), "positives": len(pos), "negatives": len(neg), "hits": len(hits), "correct_hits": correct,
        "hit_rate": round(correct / len(pos), 4) if pos else None,
        "false_hit_rate": round(sum(m is not None for _, m in neg) / len(neg), 4) if neg else None,
        "precision": round(correct / len(hits), 4) if hits else None,
    }


def score(rows: list[tuple[Pair, SemanticMatch | None]]) -> dict:
    """Overall rates, plus per tier (precision of each tier's hits) and per language."""
    out = _rates(rows)
    out["by_tier"] = {}
    for tier in ("serve", "similar"):
        hits = [(p, m) for p, m in rows if m is not None and m.tier == tier]
        correct = sum(p.same and m.entry_id == p.cached for p, m in hits)
        out["by_tier"][tier] = {"hits": len(hits), "correct_hits": correct,
                                "precision": round(correct / len(hits), 4) if hits else None}
    langs = sorted({p.lang for p, _ in rows})
    out["by_lang"] = {lang: _rates([(p, m) for p, m in rows if p.lang == lang]) for lang in langs}
    return out


def answer_pairs(cache: SemanticCache, pairs: list[Pair]) -> list[tuple[Pair, SemanticMatch | None]]:
    """Fill the (empty) cache from the pairs and ask every query once."""
    if len(cache):
        raise ValueError("the quality bench needs an empty cache")
    queries = fill(cache, pairs)
    answers = {q: cache.lookup(q, PARTITION, vec) for q, vec in queries.items()}
    return [(p, answers[p.query]) for p in pairs]


def evaluate_pairs(cache: SemanticCache, pairs: list[Pair]) -> dict:
    """The bench on one pairs list: fill, ask, score."""
    return score(answer_pairs(cache, pairs))


async def run_bypass(path: Path, semantic: SemanticCache) -> dict:
    """Ask each query twice through the full RequestCache (policy, exact, semantic, write-back)."""
    from strata.cache.request.config import RequestCacheConfig
    from strata.cache.request.request_cache import CacheRequest, RequestCache

    numbered = jsonl_rows(path)
    for number, row in numbered:
        if not isinstance(row, dict) or not isinstance(row.get("query"), str):
            raise ValueError(f"{path}: line {number}: expected an object with a 'query' string")
    rows = [row for _, row in numbered]
    if not rows:
        raise ValueError(f"{path}: expected JSONL lines with a 'query'")
    cache = RequestCache(RequestCacheConfig(), semantic=semantic)
    try:
        by_why: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for i, row in enumerate(rows):
            req = CacheRequest(tenant="default", model="bench@0", messages=[{"role": "user", "content": row["query"]}],
                               sampling={"temperature": 0})
            await cache.get_or_compute(req, lambda i=i: _answer(i))
            await cache.drain()
            _, second = await cache.get_or_compute(req, lambda i=i: _answer(i))
            by_why[row.get("why", "")][0] += 1
            by_why[row.get("why", "")][1] += second.hit is None
        written = cache.stats()["entries"]["store"]
    finally:
        cache.close()
    not_served = sum(n for _, n in by_why.values())
    return {"queries": len(rows), "bypass_rate": round(not_served / len(rows), 4), "written": written,
            "by_why": {why: {"queries": q, "bypass_rate": round(n / q, 4)} for why, (q, n) in sorted(by_why.items())}}


async def _answer(i: int) -> str:
    return f"answer-{i}"


@dataclass
class Seen:
    """What one pairwise run computed that another over the same pairs and models (another bound) reuses."""

    vectors: dict[str, np.ndarray] = field(default_factory=dict)
    scores: dict[tuple[str, str], float] = field(default_factory=dict)


class _Memo:
    """The second stage, remembering its scores: the curve reuses what the decisions already computed."""

    def __init__(self, scorer, seen: dict[tuple[str, str], float]):
        self.scorer, self.seen = scorer, seen

    def score(self, cached: str, query: str) -> float:
        key = (cached, query)
        if key not in self.seen:
            self.seen[key] = self.scorer.score(cached, query)
        return self.seen[key]


def pairwise(cache: SemanticCache, pairs: list[Pair], seen: Seen | None = None) -> dict:
    """Each pair alone through SemanticCache.decide; rates overall, per language and tier, and the curve.
    seen: embeddings and second-stage scores kept across calls with the same models."""
    seen = Seen() if seen is None else seen
    vectors = fill_vectors(cache, pairs, known=seen.vectors)
    memo = _Memo(cache.scorer, seen.scores) if cache.scorer is not None else None
    scorer, cache.scorer = cache.scorer, memo
    try:
        rows, scores = [], []
        for p in pairs:
            cosine = float(np.dot(vectors[p.cached], vectors[p.query]))
            rows.append((p, cache.decide(p.query, [(p.cached, cosine, p.cached)])))
            floor = cache.min_similarity(p.query) if memo is not None else -math.inf
            if memo is not None:
                scores.append(decision_score(memo.score(p.cached, p.query), cosine) if cosine >= floor else -math.inf)
            else:
                scores.append(cosine)
    finally:
        cache.scorer = scorer
    out = {"all": _pair_rates(rows)}
    out |= {lang: _pair_rates([r for r in rows if r[0].lang == lang]) for lang in LANGUAGES
            if any(p.lang == lang for p, _ in rows)}
    out["by_tier"] = {tier: _pair_rates([(p, m if m is not None and m.tier == tier else None) for p, m in rows])
                      for tier in ("serve", "similar")}
    cosines = [float(np.dot(vectors[p.cached], vectors[p.query])) for p in pairs]
    langs = [lang for lang in LANGUAGES if any(p.lang == lang for p in pairs)]
    same = {lang: np.array([p.same for p in pairs if p.lang == lang]) for lang in langs}

    def of(values: list[float], lang: str) -> np.ndarray:
        return np.array([v for p, v in zip(pairs, values, strict=True) if p.lang == lang])

    out["curve"] = {lang: curve(same[lang], of(scores, lang)) for lang in langs}
    out["cosine_curve"] = {lang: curve(same[lang], of(cosines, lang)) for lang in langs}   # the baseline it beats
    return out


def _pair_rates(rows: list[tuple[Pair, SemanticMatch | None]]) -> dict:
    """{"hit_rate", "precision", "false_hit_rate", "pairs"} of one serve decision per pair."""
    pos = sum(p.same for p, _ in rows)
    served = [(p, m) for p, m in rows if m is not None]
    correct = sum(p.same for p, _ in served)
    neg = len(rows) - pos
    return {"hit_rate": round(correct / pos, 4) if pos else None,
            "precision": round(correct / len(served), 4) if served else None,
            "false_hit_rate": round((len(served) - correct) / neg, 4) if neg else None,
            "pairs": len(rows), "positives": pos, "served": len(served)}


def curve(same: np.ndarray, score: np.ndarray) -> dict:
    """Best hit rate of any threshold on this score at each precision, in hindsight on these pairs (what the
    operating point could reach at best here, not a deployable setting)."""
    if not len(same) or not same.any():
        return {f"hit_at_precision_{q}": None for q in CURVE_PRECISIONS} | {"auc": None}
    order = np.argsort(-score, kind="stable")
    keep = np.isfinite(score[order])
    hits = np.cumsum(same[order] & keep)
    served = np.cumsum(keep)
    precision = hits / np.maximum(served, 1)
    ranked = score[order]
    cut = np.r_[ranked[1:] != ranked[:-1], True] & keep    # a threshold serves a tie whole: only its end is a point
    out = {f"hit_at_precision_{q}": round(float((hits[(precision >= q) & cut].max(initial=0)) / same.sum()), 4)
           for q in CURVE_PRECISIONS}
    points = np.unique(np.linspace(0, int(keep.sum()) - 1, 40).astype(int)) if keep.any() else []
    out["points"] = [[round(float(hits[i] / same.sum()), 4), round(float(precision[i]), 4)] for i in points]
    # pairs below the cosine floor were never scored: they rank last, together
    out["auc"] = round(float(roc_auc_score(same, np.where(np.isfinite(score), score, -1e9))), 4) if (~same).any() else None
    return out


def fill_vectors(cache: SemanticCache, pairs: list[Pair], batch: int = 64,
                 known: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Embeddings of every distinct text of the pairs, encoded in batches (those in `known` are not, and it gains
    the new ones)."""
    vectors = {} if known is None else known
    texts = [t for t in dict.fromkeys(t for p in pairs for t in (p.cached, p.query)) if t not in vectors]
    for start in range(0, len(texts), batch):
        chunk = texts[start:start + batch]
        vectors.update(zip(chunk, cache.embedder.encode(chunk), strict=True))
    return vectors


def select(path: Path, split: str | None, datasets: Path | None) -> list[Pair]:
    """The pairs of a file, or of one split of it when it is a shared data set (split over all shared files)."""
    pairs = load_pairs(path)
    if split is None:
        return pairs
    keep = {(p.cached, p.query) for p in shared_split(datasets_dir(datasets), split)}
    chosen = [p for p in pairs if (p.cached, p.query) in keep]
    if not chosen:
        raise ValueError(f"{path} has no pairs in the {split} split of the shared data sets")
    return chosen


def run_cache_quality(pairs: Path | None, bypass: Path | None, config: RequestCacheConfig, split: str | None = None,
                      datasets: Path | None = None, full_cache: bool = True, seen: Seen | None = None) -> dict:
    """Run the quality bench on a pairs file (or one split of a shared file), the bypass file, or both, with the
    semantic layer `config` describes (its defaults are `strata serve`'s); seen: see pairwise."""
    if pairs is None and bypass is None:
        raise ValueError("give --pairs FILE and/or --bypass FILE")
    result: dict = {}
    if pairs is not None:
        rows = select(pairs, split, datasets)
        cache = SemanticCache.from_config(config)
        if full_cache:
            result.update(evaluate_pairs(cache, rows))
        result["pairwise"] = pairwise(SemanticCache.from_config(config), rows, seen)
        result.update({"file": str(pairs), "split": split or "all", "embedder": cache.embedder.name,
                       "second_stage": config.second_stage, "max_error": config.semantic_max_error,
                       "top_k": config.semantic_top_k, "operating_point": _tiers(cache),
                       "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, no GPU"})
    if bypass is not None:
        result["bypass"] = asyncio.run(run_bypass(bypass, SemanticCache.from_config(config)))
        result.update(bypass_rate=result["bypass"]["bypass_rate"], written=result["bypass"]["written"])
    return result


def _tiers(cache: SemanticCache) -> dict:
    t = cache.tiers
    table = {lang: getattr(t, lang) for lang in LANGUAGES} if isinstance(t, TierTable) else {"all": t}
    return {lang: None if x.off else {"serve": round(x.serve, 4) if math.isfinite(x.serve) else None,
                                      "similar": round(x.similar, 4), "floor": round(x.floor, 4)}
            for lang, x in table.items()}
