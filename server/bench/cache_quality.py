"""`strata bench cache-quality`: precision and hit rate of the semantic cache on labelled question pairs.

Protocol (the shared datasets' README.md): fill an empty cache with every distinct cached question (its
answer is its own id), ask every query; a hit on the pair's own question when same=true is correct, any
other hit is false, no hit is a miss.
"""
from __future__ import annotations

import asyncio
import csv
import json
import os
import platform
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from strata.cache.request.config import RequestCacheConfig
from strata.cache.request.semantic import SemanticCache, SemanticMatch, ThresholdTable

PARTITION = "bench"
_CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff]")


@dataclass(slots=True)
class Pair:
    """One labelled (cached question, query) pair."""

    cached: str
    query: str
    same: bool
    lang: str


def detect_lang(text: str) -> str:
    """"zh" when a fifth or more of the characters are CJK, else "en" (enough to split the bench sets)."""
    return "zh" if len(_CJK.findall(text)) * 5 >= max(len(text.replace(" ", "")), 1) else "en"


def load_pairs(path: Path) -> list[Pair]:
    """Read JSONL {cached, query, same, lang}, the shared CSV/TSV (sentence1, sentence2, label) or JSON [{origin, similar}]."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"pairs file not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        missing = [i for i, r in enumerate(rows) if not {"cached", "query", "same"} <= r.keys()]
        if missing:
            raise ValueError(f"{path}: line {missing[0] + 1} lacks one of cached/query/same")
        pairs = [Pair(r["cached"], r["query"], bool(r["same"]), r.get("lang") or detect_lang(r["cached"])) for r in rows]
    elif suffix in (".csv", ".tsv"):
        with path.open(encoding="utf-8", newline="") as f:
            rows = list(csv.DictReader(f, delimiter="\t" if suffix == ".tsv" else ","))
        if not rows or not {"sentence1", "sentence2", "label"} <= rows[0].keys():
            raise ValueError(f"{path}: expected columns sentence1, sentence2, label")
        pairs = [Pair(r["sentence1"], r["sentence2"], r["label"].strip() == "1", detect_lang(r["sentence1"])) for r in rows]
    elif suffix == ".json":
        rows = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(rows, list) or not all(isinstance(r, dict) and {"origin", "similar"} <= r.keys() for r in rows):
            raise ValueError(f"{path}: expected a JSON list of {{origin, similar}}")
        pairs = [Pair(r["origin"], r["similar"], True, detect_lang(r["origin"])) for r in rows]
    else:
        raise ValueError(f"{path}: unknown pairs format {suffix!r} (use .jsonl, .csv, .tsv or .json)")
    pairs = [p for p in pairs if p.cached.strip() and p.query.strip()]
    if not pairs:
        raise ValueError(f"{path}: no pairs")
    return pairs


def fill(cache: SemanticCache, pairs: list[Pair], batch: int = 64) -> dict[str, np.ndarray]:
    """Add every distinct cached question (id = its text) and return query embeddings, encoded in batches."""
    cached = list(dict.fromkeys(p.cached for p in pairs))
    queries = list(dict.fromkeys(p.query for p in pairs))
    vectors = {}
    for texts in (cached, queries):
        for i in range(0, len(texts), batch):
            chunk = texts[i:i + batch]
            vectors.update(zip(chunk, cache.embedder.encode(chunk), strict=True))
    for text in cached:
        cache.add(text, text, PARTITION, vectors[text])
    return {q: vectors[q] for q in queries}


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

    rows = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    if not rows or not all("query" in r for r in rows):
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


def run_cache_quality(pairs: Path | None, bypass: Path | None, config: RequestCacheConfig) -> dict:
    """Run the quality bench on a pairs file, the bypass file, or both, with the semantic layer `config` describes
    (its defaults are `strata serve`'s)."""
    if pairs is None and bypass is None:
        raise ValueError("give --pairs FILE and/or --bypass FILE")
    result: dict = {}
    if pairs is not None:
        cache = SemanticCache.from_config(config)
        result.update(evaluate_pairs(cache, load_pairs(pairs)))
        result.update({"file": str(pairs), "embedder": cache.embedder.name, "second_stage": config.second_stage,
                       "top_k": config.semantic_top_k, "thresholds": _thresholds(cache),
                       "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, no GPU"})
    if bypass is not None:
        result["bypass"] = asyncio.run(run_bypass(bypass, SemanticCache.from_config(config)))
        result.update(bypass_rate=result["bypass"]["bypass_rate"], written=result["bypass"]["written"])
    return result


def _thresholds(cache: SemanticCache) -> dict:
    t = cache.thresholds
    sets = {"en": t.en, "zh": t.zh} if isinstance(t, ThresholdTable) else {"all": t}
    keys = ("serve", "similar", "verify_serve", "verify_similar") if cache.verifier else ("serve", "similar")
    return {lang: {k: getattr(x, k) for k in keys} for lang, x in sets.items()}
