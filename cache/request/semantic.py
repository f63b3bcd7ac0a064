"""Semantic request cache: embed once, top-k in the request's partition, second-stage check, tiered decision.

The decision (decide) is one place: cosine top-k, then the cross-encoder on the closest candidates above a cosine
floor, then the tiers certified for the user's error bound (calibration.py)."""
from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from cachetools import LRUCache

from .calibration import CALIBRATION_PATH, ScoredPairs, Tiers, TierTable, decision_score, fit_tiers, language_of
from .embedders import Embedder
from .index import VectorIndex

if TYPE_CHECKING:
    from .config import RequestCacheConfig

log = logging.getLogger(__name__)

@dataclass(slots=True)
class SemanticMatch:
    """A served semantic hit: which candidate (a stored entry, or a pending request), how close, in which tier."""

    entry_id: str
    similarity: float
    tier: str
    cached_text: str
    score: float | None = None          # the second stage's decision score (None: decided on cosine alone)


@dataclass(slots=True)
class _Entry:
    text: str
    partition: str


class SemanticCache:
    """Nearest-neighbour lookup of earlier questions, one faiss index per partition so partitions never starve each other."""

    def __init__(self, embedder: Embedder, tiers: Tiers | TierTable, scorer=None, *, top_k: int = 5,
                 rerank: int = 1, hnsw_min_size: int = 10_000, embed_cache_size: int = 4096):
        """scorer: the second stage (cross_encoder.CrossEncoder: score(cached, query) -> logit) or None to decide on
        cosine alone; rerank: how many of the closest candidates above the floor it reads at most."""
        if top_k < 1 or rerank < 1:
            raise ValueError("top_k and rerank must be >= 1")
        self.embedder = embedder
        self.tiers = tiers
        self.scorer = scorer
        self.top_k = top_k
        self.rerank = rerank
        self.hnsw_min_size = hnsw_min_size
        self.calibration: dict = {}            # what fit_tiers certified, per language (for logs, stats, /metrics)
        self._embeddings: LRUCache = LRUCache(maxsize=embed_cache_size)
        self._indexes: dict[str, VectorIndex] = {}
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.RLock()
        self._encode_lock = contextlib.nullcontext() if getattr(embedder, "concurrent", False) else threading.Lock()

    @classmethod
    def create(cls, embedder: str = "auto", second_stage: bool = True, max_error: float = 0.02,
               calibration: str | Path | None = None, **kwargs) -> SemanticCache:
        """The shipped semantic layer for a named embedder: its second stage (unless off) and the tiers that the
        calibration pairs certify for the error bound max_error; a language nothing certifies is not served."""
        from .cross_encoder import CrossEncoder, shared_cross_encoder
        from .embedders import load_embedder

        model = load_embedder(embedder)
        data = ScoredPairs.load(Path(calibration) if calibration else CALIBRATION_PATH)
        scorer = None
        if second_stage:    # a calibration file may bundle a second stage fitted to its own pairs
            scorer = CrossEncoder(data.adapter) if data.adapter is not None else shared_cross_encoder()
        if scorer is not None and data.meta.get("second_stage") != scorer.version:
            raise ValueError(f"the calibration pairs were scored by second stage {data.meta.get('second_stage')!r}, "
                             f"this one is {scorer.version!r}: run `strata calibrate` again")
        tiers, report = fit_tiers(data, model.name, second_stage, max_error)
        cache = cls(model, tiers, scorer, **kwargs)
        language_of("warm up")      # loads the language identifier now, not in the first lookup (0.7 s)
        cache.calibration = {"max_error": max_error, "second_stage": second_stage, "languages": report}
        for lang, what in report.items():
            if getattr(tiers, lang).off:
                log.warning("semantic hits off for %s: no threshold keeps false hits within %.3f at 95%% confidence "
                            "on the calibration pairs (%s)", lang, max_error, what)
            else:
                log.info("semantic tiers for %s: %s", lang, what)
        return cache

    @classmethod
    def from_config(cls, config: RequestCacheConfig) -> SemanticCache:
        """The semantic layer a RequestCacheConfig describes."""
        return cls.create(config.embedder, config.second_stage, config.semantic_max_error, config.semantic_calibration,
                          top_k=config.semantic_top_k, rerank=config.semantic_rerank,
                          hnsw_min_size=config.hnsw_min_size, embed_cache_size=config.embed_cache_size)

    def __len__(self) -> int:
        return len(self._entries)

    def embed(self, text: str) -> np.ndarray:
        """L2-normalised float32 embedding, LRU-cached so a request is embedded once for lookup and write-back."""
        if not isinstance(text, str) or not text.strip():
            raise ValueError("cannot embed an empty or non-string text")
        with self._lock:
            hit = self._embeddings.get(text)
        if hit is not None:
            return hit
        with self._encode_lock:  # a serial embedder's encode already fans out over the cores: one at a time
            vec = np.asarray(self.embedder.encode([text])[0], dtype=np.float32)
        vec.setflags(write=False)
        with self._lock:
            self._embeddings[text] = vec
        return vec

    def add(self, entry_id: str, text: str, partition: str, embedding: np.ndarray | None = None) -> None:
        """Index a question under its partition (re-adding an id replaces it)."""
        vec = self.embed(text) if embedding is None else self._check(embedding)
        with self._lock:
            self.remove(entry_id)
            index = self._indexes.get(partition)
            if index is None:
                index = self._indexes[partition] = VectorIndex(self.embedder.dim, hnsw_min_size=self.hnsw_min_size)
            index.add(entry_id, vec)
            self._entries[entry_id] = _Entry(text, partition)

    def remove(self, entry_id: str) -> None:
        """Forget one entry (no-op when absent); an emptied partition drops its index."""
        with self._lock:
            entry = self._entries.pop(entry_id, None)
            if entry is None:
                return
            index = self._indexes[entry.partition]
            index.remove(entry_id)
            if not len(index):
                del self._indexes[entry.partition]

    def ids(self) -> list[str]:
        """Every indexed entry id (a resync drops the ones the store no longer has)."""
        with self._lock:
            return list(self._entries)

    def candidates(self, text: str, partition: str, embedding: np.ndarray | None = None) -> list[tuple[str, float, str]]:
        """Top-k (entry id, cosine, cached text) in the partition, best first, before any decision."""
        vec = self.embed(text) if embedding is None else self._check(embedding)
        with self._lock:
            index = self._indexes.get(partition)
            found = index.search(vec, self.top_k) if index is not None else []
            return [(eid, sim, self._entries[eid].text) for eid, sim in found]

    def lookup(self, text: str, partition: str, embedding: np.ndarray | None = None) -> SemanticMatch | None:
        """The stored question that may answer this one (see decide), tiered; None means compute."""
        return self.decide(text, self.candidates(text, partition, embedding))

    def decide(self, text: str, candidates: Iterable[tuple[str, float, str]]) -> SemanticMatch | None:
        """Which of these (id, cosine, question) candidates may answer `text`, and in which tier; None: none may.

        The one place that decides, for stored entries (lookup) and for pending requests (single-flight) alike.
        With a second stage, the closest `rerank` candidates at cosine >= the language's floor are read together with
        the question and the best certified score (calibration.decision_score) wins; without one, the closest
        candidate's cosine is the score. A question in another language never answers: its answer is in that
        language, however close the multilingual embedding puts a translation.
        """
        t = self.tiers.for_text(text)
        if t.off:
            return None
        language = language_of(text)
        best: SemanticMatch | None = None
        read = 0
        for cid, sim, cached in sorted(candidates, key=lambda c: -c[1]):
            if sim < self.min_similarity(text) or read >= self.rerank:
                break
            if language_of(cached) != language:
                continue
            if self.scorer is None:
                tier = t.tier(sim)
                return SemanticMatch(cid, sim, tier, cached) if tier else None
            score = decision_score(self.scorer.score(cached, text), sim)
            read += 1
            tier = t.tier(score)
            if tier is not None and (best is None or score > best.score):
                best = SemanticMatch(cid, sim, tier, cached, score)
        return best

    def serves(self, text: str) -> bool:
        """False where the error bound certified nothing for the text's language: a lookup could never hit, so the
        caller skips embedding and search (the write still embeds, off the request path)."""
        return not self.tiers.for_text(text).off

    def min_similarity(self, text: str) -> float:
        """The cosine below which decide() accepts nothing for `text`: callers may drop such candidates first."""
        t = self.tiers.for_text(text)
        return t.floor if self.scorer is not None else t.similar

    def similar_ids(self, text: str, min_similarity: float, partition: str | None = None) -> list[str]:
        """Ids of entries at cosine >= min_similarity (for invalidation), across all partitions when none is given."""
        vec = self.embed(text)
        with self._lock:
            indexes = [self._indexes[partition]] if partition in self._indexes else [] if partition else list(self._indexes.values())
            return [eid for index in indexes for eid, sim in index.search(vec, len(index)) if sim >= min_similarity]

    def _check(self, embedding: np.ndarray) -> np.ndarray:
        vec = np.asarray(embedding, dtype=np.float32).reshape(-1)
        if vec.shape[0] != self.embedder.dim:
            raise ValueError(f"embedding has dim {vec.shape[0]}, embedder {self.embedder.name} has {self.embedder.dim}")
        return vec
