"""Score labelled pairs the way the semantic layer sees them (each embedder's cosine, the cross-encoder's logit), so
that calibration.fit_tiers can certify thresholds on them: `strata calibrate`, and the shipped calibration file."""
from __future__ import annotations

import datetime
import os
from pathlib import Path

import numpy as np
from tqdm import tqdm

from strata.cache.request.calibration import ScoredPairs
from strata.cache.request.cross_encoder import CrossEncoder
from strata.cache.request.embedders import load_embedder
from strata.server.tuning.pairs import Pair


def cosines(embedder_name: str, pairs: list[Pair], batch: int = 64) -> np.ndarray:
    """Cosine of each pair's two questions under one embedder (each distinct text embedded once); NaN for the
    languages an embedder was not made for (they are never calibrated, so never served)."""
    embedder = load_embedder(embedder_name)
    languages = getattr(embedder, "languages", ("en", "zh"))
    texts = list(dict.fromkeys(t for p in pairs if p.lang in languages for t in (p.cached, p.query)))
    vectors = {}
    for start in tqdm(range(0, len(texts), batch), desc=f"embedding ({embedder.name})", unit="batch", mininterval=10):
        chunk = texts[start:start + batch]
        vectors.update(zip(chunk, embedder.encode(chunk), strict=True))
    return np.array([float(np.dot(vectors[p.cached], vectors[p.query])) if p.lang in languages else np.nan
                     for p in pairs])


def score_pairs(pairs: list[Pair], embedders: list[str], cross_encoder: CrossEncoder | None, source: str,
                adapter: dict[str, np.ndarray] | None = None) -> ScoredPairs:
    """ScoredPairs for `pairs`: every listed embedder's cosine and, given a cross-encoder, its logit; `adapter`
    (the cross-encoder's own arrays when it was fitted for these pairs) is bundled with them."""
    score = np.full(len(pairs), np.nan)
    if cross_encoder is not None:
        for i, p in enumerate(tqdm(pairs, desc="cross-encoder", unit="pair", mininterval=10)):
            score[i] = cross_encoder.score(p.cached, p.query)
    meta = {"second_stage": cross_encoder.version if cross_encoder is not None else None, "source": source,
            "pairs": len(pairs), "created": datetime.date.today().isoformat()}
    return ScoredPairs(np.array([p.same for p in pairs]), np.array([p.lang for p in pairs]),
                       np.array([p.domain for p in pairs]), score,
                       {load_embedder(name).name: cosines(name, pairs) for name in embedders}, meta, adapter)


def writable_out(out: Path) -> None:
    """OSError now, naming --out, when the calibration file could not be written there (checked before scoring)."""
    folder = out.parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        raise OSError(f"--out {out}: cannot write there ({folder} is not a writable folder)")
    if out.exists() and not os.access(out, os.W_OK):
        raise OSError(f"--out {out}: the file is not writable")


def write(scored: ScoredPairs, out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    scored.save(out)
    return out
