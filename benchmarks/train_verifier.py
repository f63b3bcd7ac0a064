"""Fit the second-stage verifier (logistic regression over contrast features) per embedder; write JSON weights.

Rows are what the cache really sees: for every query of every shared dev set, its top-k candidates from a
cache filled with that file's cached questions, labelled 1 only for the pair's own question when same=true.
Pairs are split by cached question (30% held out, same split in calibrate_semantic.py). We fit on the train
split of the three query-style files together, on each query's top FIT_TOP_K candidates (the ones a decision
can turn on), and report held-out AUC per file. PAWS-X is reported, not fitted: its negatives are word-order
swaps of encyclopedia sentences with full word overlap, and fitting them teaches "same words = different
question", the opposite of what cache traffic needs (held-out en_hard hit rate at precision 0.97 fell from
0.70 to 0.14 when PAWS-X was fitted with full weight).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/train_verifier.py --embedders e5-small minilm use-multilingual
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from strata.cache.request.contrast import FEATURES, Contrast, contrast
from strata.cache.request.embedders import load_embedder
from strata.cache.request.semantic import SemanticCache, Thresholds
from strata.cache.request.verifier import WEIGHTS_PATH
from strata.server.bench.cache_quality import PARTITION, Pair, fill, load_pairs
from strata.server.bench.data_files import DATASETS_ENV, datasets_dir

DATASETS = ("en_hard_pairs.csv", "zh_faq_pairs.jsonl", "zh_pawsx_dev.tsv", "en_paraphrases_gptcache.json")
EMB_CACHE = Path("/tmp/strata_semantic_emb")
FIT_SETS = ("en_hard_pairs.csv", "zh_faq_pairs.jsonl", "en_paraphrases_gptcache.json")
TOP_K = 5
FIT_TOP_K = 2


def held_out(pair: Pair) -> bool:
    """30% of cached questions (by hash, so every embedder and script agrees) are never fitted on."""
    return int(hashlib.sha1(pair.cached.encode()).hexdigest(), 16) % 10 < 3


class DiskCachedEmbedder:
    """Wraps a real embedder with an on-disk vector cache so that reruns of the scripts skip the model."""

    def __init__(self, name: str):
        self.inner = load_embedder(name)
        self.name, self.dim = self.inner.name, self.inner.dim
        # Named by what the embedder computes, not only its name: a new implementation never reuses old vectors.
        probe = np.round(self.inner.encode(["fingerprint probe / 指纹探针"])[0], 4).astype(np.float32).tobytes()
        self.path = EMB_CACHE / f"{self.name}-{hashlib.sha1(probe).hexdigest()[:12]}.npz"
        self.store: dict[str, np.ndarray] = {}
        if self.path.exists():
            with np.load(self.path) as z:
                self.store = dict(zip(json.loads(str(z["texts"])), z["vectors"], strict=True))
        self.dirty = False

    def encode(self, texts: list[str]) -> np.ndarray:
        todo = [t for t in dict.fromkeys(texts) if t not in self.store]
        if todo:
            self.store.update(zip(todo, self.inner.encode(todo), strict=True))
            self.dirty = True
        return np.stack([self.store[t] for t in texts])

    def save(self) -> None:
        if self.dirty:
            EMB_CACHE.mkdir(parents=True, exist_ok=True)
            texts = list(self.store)
            np.savez(self.path, texts=json.dumps(texts), vectors=np.stack([self.store[t] for t in texts]))


@dataclass(slots=True)
class Scored:
    """One query of one pair with its top-k candidates: (entry id, cosine, cached text, contrast)."""

    pair: Pair
    candidates: list[tuple[str, float, str, Contrast]]


def candidate_rows(embedder: DiskCachedEmbedder, dataset: str, top_k: int = TOP_K) -> list[Scored]:
    """Fill a cache with the file's cached questions and collect each query's top-k with contrast features."""
    pairs = load_pairs(datasets_dir() / dataset)
    cache = SemanticCache(embedder, Thresholds(serve=1.0, similar=-1.0), top_k=top_k)
    queries = fill(cache, pairs)
    found = {q: cache.candidates(q, PARTITION, vec) for q, vec in queries.items()}
    feats = {(q, cached): contrast(q, cached, sim) for q, cands in found.items() for _, sim, cached in cands}
    return [Scored(p, [(eid, sim, cached, feats[p.query, cached]) for eid, sim, cached in found[p.query]]) for p in pairs]


def to_xy(scored: list[Scored], top_k: int = TOP_K) -> tuple[np.ndarray, np.ndarray]:
    """Feature rows and labels (1 = the pair's own question and same=true) of each query's first top_k candidates
    that pass the contrast guard: the verifier only ever judges those."""
    rows = [(c, s.pair.same and eid == s.pair.cached) for s in scored for eid, _, _, c in s.candidates[:top_k]]
    x = [c.values for c, _ in rows if not c.conflict]
    y = [float(label) for c, label in rows if not c.conflict]
    return np.asarray(x, dtype=np.float64).reshape(-1, len(FEATURES)), np.asarray(y)


def fit(x: np.ndarray, y: np.ndarray) -> dict:
    """Standardised L2 logistic regression; returns the JSON-able model."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    scaler = StandardScaler().fit(x)
    lr = LogisticRegression(C=1.0, max_iter=2000).fit(scaler.transform(x), y)
    scale = np.where(scaler.scale_ > 0, scaler.scale_, 1.0)
    return {"mean": scaler.mean_.round(6).tolist(), "scale": scale.round(6).tolist(),
            "coef": lr.coef_[0].round(6).tolist(), "intercept": round(float(lr.intercept_[0]), 6)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--datasets", help=f"datasets folder (default: ${DATASETS_ENV}, else ../shared/datasets)")
    ap.add_argument("--embedders", nargs="+", default=["e5-small", "minilm", "use-multilingual"])
    ap.add_argument("--out", type=Path, default=WEIGHTS_PATH)
    args = ap.parse_args()
    if args.datasets:
        os.environ[DATASETS_ENV] = args.datasets
    from sklearn.metrics import roc_auc_score

    out = {"features": list(FEATURES), "top_k": TOP_K, "fit_top_k": FIT_TOP_K, "fit_sets": list(FIT_SETS),
           "split": "sha1(cached) % 10 < 3 held out", "embedders": {}}
    if args.out.exists():
        old = json.loads(args.out.read_text())
        if old.get("features") == list(FEATURES):
            out["embedders"] = old["embedders"]
    for name in args.embedders:
        t0 = time.time()
        emb = DiskCachedEmbedder(name)
        rows = {d: candidate_rows(emb, d) for d in DATASETS}
        emb.save()
        x, y = to_xy([s for d in FIT_SETS for s in rows[d] if not held_out(s.pair)], FIT_TOP_K)
        model = fit(x, y)
        report = {}
        for d in DATASETS:
            hx, hy = to_xy([s for s in rows[d] if held_out(s.pair)])
            z = model["intercept"] + ((hx - model["mean"]) / model["scale"]) @ np.asarray(model["coef"])
            cos_auc = roc_auc_score(hy, hx[:, 0]) if 0 < hy.sum() < len(hy) else None
            report[d] = {"held_out_rows": len(hy), "auc_verifier": round(roc_auc_score(hy, z), 4) if cos_auc else None,
                         "auc_cosine": round(cos_auc, 4) if cos_auc else None}
        out["embedders"][emb.name] = {**model, "train_rows": len(y), "held_out": report}
        print(json.dumps({emb.name: {"coef": dict(zip(FEATURES, model["coef"], strict=True)), "held_out": report,
                                     "seconds": round(time.time() - t0, 1)}}, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
