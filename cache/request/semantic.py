"""Semantic request cache: embed once, top-k in the request's partition, second-stage check, tiered decision."""
from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from cachetools import LRUCache

from .contrast import is_cjk
from .embedders import Embedder
from .index import VectorIndex
from .verifier import Verifier

if TYPE_CHECKING:
    from .config import RequestCacheConfig

THRESHOLDS_PATH = Path(__file__).with_name("data") / "semantic_thresholds.json"


@dataclass(slots=True)
class Thresholds:
    """Per-embedder tier boundaries (cosine scales differ a lot between embedders); fitted by calibrate_semantic.py.

    A candidate needs cosine >= similar and, with a verifier, P(same) >= verify_similar to be served as
    "based on a similar question"; cosine >= serve and P(same) >= verify_serve serves it plainly.
    """

    serve: float
    similar: float
    verify_serve: float = 0.0
    verify_similar: float = 0.0

    def __post_init__(self):
        if not -1.0 <= self.similar <= self.serve <= 1.0:
            raise ValueError(f"need -1 <= similar <= serve <= 1, got similar={self.similar} serve={self.serve}")
        if not 0.0 <= self.verify_similar <= self.verify_serve <= 1.0:
            raise ValueError(f"need 0 <= verify_similar <= verify_serve <= 1, got {self.verify_similar}, {self.verify_serve}")

    def for_text(self, text: str) -> Thresholds:
        """One set for every language."""
        return self


@dataclass(slots=True)
class ThresholdTable:
    """Thresholds per script, fitted jointly: embedders score Chinese paraphrases on another cosine scale."""

    en: Thresholds
    zh: Thresholds

    def for_text(self, text: str) -> Thresholds:
        """The Chinese set when the question has Chinese characters, else the default (English) set."""
        return self.zh if is_cjk(text) else self.en

    @classmethod
    def load(cls, embedder: str, second_stage: bool = True, path: Path = THRESHOLDS_PATH) -> ThresholdTable:
        """Calibrated thresholds for this embedder (benchmarks/calibrate_semantic.py), with or without the verifier."""
        table = json.loads(Path(path).read_text(encoding="utf-8"))
        if embedder not in table:
            raise KeyError(f"no calibrated thresholds for embedder {embedder!r} in {path} (have {sorted(table)})")
        sets = table[embedder]["verified" if second_stage else "cosine_only"]
        return cls(**{lang: Thresholds(**sets[lang]) for lang in ("en", "zh")})


@dataclass(slots=True)
class SemanticMatch:
    """A served semantic hit: which candidate (a stored entry, or a pending request), how close, in which tier."""

    entry_id: str
    similarity: float
    tier: str
    cached_text: str
    verifier_p: float | None = None


@dataclass(slots=True)
class _Entry:
    text: str
    partition: str


class SemanticCache:
    """Nearest-neighbour lookup of earlier questions, one faiss index per partition so partitions never starve each other."""

    def __init__(self, embedder: Embedder, thresholds: Thresholds | ThresholdTable, verifier: Verifier | None = None, *,
                 top_k: int = 5, hnsw_min_size: int = 10_000, embed_cache_size: int = 4096):
        if top_k < 1:
            raise ValueError("top_k must be >= 1")
        self.embedder = embedder
        self.thresholds = thresholds
        self.verifier = verifier
        self.top_k = top_k
        self.hnsw_min_size = hnsw_min_size
        self._embeddings: LRUCache = LRUCache(maxsize=embed_cache_size)
        self._indexes: dict[str, VectorIndex] = {}
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.RLock()
        self._encode_lock = contextlib.nullcontext() if getattr(embedder, "concurrent", False) else threading.Lock()

    @classmethod
    def create(cls, embedder: str = "auto", second_stage: bool = True, **kwargs) -> SemanticCache:
        """The shipped configuration for a named embedder: its calibrated thresholds and, with second_stage, its verifier."""
        from .embedders import load_embedder

        model = load_embedder(embedder)
        verifier = Verifier.load(model.name) if second_stage else None
        return cls(model, ThresholdTable.load(model.name, second_stage), verifier, **kwargs)

    @classmethod
    def from_config(cls, config: RequestCacheConfig) -> SemanticCache:
        """The semantic layer a RequestCacheConfig describes."""
        return cls.create(config.embedder, config.second_stage, top_k=config.semantic_top_k,
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

        The one place that decides, for stored entries (lookup) and for pending requests (single-flight) alike:
        the cosine floor, the second stage (contrast guard + verifier) and the tiers. The candidate with the highest
        P(same) wins; without a verifier, the closest one.
        """
        t = self.thresholds.for_text(text)
        best: SemanticMatch | None = None
        for cid, sim, cached in sorted(candidates, key=lambda c: -c[1]):
            if sim < t.similar:
                break
            if self.verifier is None:
                return SemanticMatch(cid, sim, "serve" if sim >= t.serve else "similar", cached)
            p = self.verifier.score(text, cached, sim)
            if p < t.verify_similar or (best is not None and p <= best.verifier_p):
                continue
            tier = "serve" if sim >= t.serve and p >= t.verify_serve else "similar"
            best = SemanticMatch(cid, sim, tier, cached, p)
        return best

    def min_similarity(self, text: str) -> float:
        """The cosine below which decide() accepts nothing for `text`: callers may drop such candidates first."""
        return self.thresholds.for_text(text).similar

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
