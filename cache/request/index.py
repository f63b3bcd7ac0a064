"""faiss inner-product index over unit vectors: exact while small, HNSW past a measured size."""
from __future__ import annotations

import faiss
import numpy as np

# One query at a time: OpenMP fan-out buys nothing and, on a busy host, its spin-waits make a search several times
# slower (benchmarks/semantic_latency.py).
faiss.omp_set_num_threads(1)


class VectorIndex:
    """One partition's vectors keyed by entry id; removals are tombstones filtered inside faiss, compacted lazily."""

    def __init__(self, dim: int, hnsw_min_size: int = 10_000, hnsw_m: int = 32, ef_search: int = 128):
        self.dim = dim
        self.hnsw_min_size = hnsw_min_size
        self.hnsw_m = hnsw_m
        self.ef_search = ef_search
        self._index: faiss.Index = faiss.IndexFlatIP(dim)
        self._keys: list[str | None] = []  # faiss position -> entry id, None once removed
        self._pos: dict[str, int] = {}
        self._dead: list[int] = []
        self._params_cache: faiss.SearchParameters | None = None
        self._selector_refs: tuple = ()

    def __len__(self) -> int:
        return len(self._pos)

    @property
    def is_hnsw(self) -> bool:
        return isinstance(self._index, faiss.IndexHNSWFlat)

    def add(self, key: str, vector: np.ndarray) -> None:
        """Insert or replace one unit vector."""
        self.add_batch([key], np.asarray(vector, dtype=np.float32).reshape(1, -1))

    def add_batch(self, keys: list[str], vectors: np.ndarray) -> None:
        """Insert or replace many unit vectors in one faiss call (warm-up, rebuilds, benchmarks)."""
        vecs = np.ascontiguousarray(vectors, dtype=np.float32).reshape(len(keys), -1)
        if vecs.shape[1] != self.dim:
            raise ValueError(f"vector has dim {vecs.shape[1]}, index has {self.dim}")
        if len(set(keys)) != len(keys):
            raise ValueError("duplicate keys in one batch")
        for key in keys:
            self.remove(key)
        for key in keys:
            self._pos[key] = len(self._keys)
            self._keys.append(key)
        self._index.add(vecs)
        self._params_cache = None
        if not self.is_hnsw and len(self._pos) >= self.hnsw_min_size:
            self._rebuild(hnsw=True)

    def remove(self, key: str) -> bool:
        """Tombstone one entry; rebuild once a quarter of the positions are dead."""
        pos = self._pos.pop(key, None)
        if pos is None:
            return False
        self._keys[pos] = None
        self._dead.append(pos)
        self._params_cache = None
        if len(self._dead) > max(64, len(self._pos) // 4):
            self._rebuild(hnsw=self.is_hnsw and len(self._pos) >= self.hnsw_min_size // 2)
        return True

    def search(self, vector: np.ndarray, k: int) -> list[tuple[str, float]]:
        """Top-k live entries by inner product, best first."""
        if not self._pos:
            return []
        vec = np.ascontiguousarray(vector, dtype=np.float32).reshape(1, -1)
        k = min(k, len(self._pos))
        scores, ids = self._index.search(vec, k, params=self._params())
        return [(self._keys[i], float(s)) for s, i in zip(scores[0], ids[0], strict=True) if i >= 0 and self._keys[i] is not None]

    def _params(self) -> faiss.SearchParameters | None:
        """Search parameters, cached until the next add/remove: faiss keeps raw pointers, so we hold the objects."""
        if self._params_cache is not None or (not self._dead and not self.is_hnsw):
            return self._params_cache
        params = faiss.SearchParametersHNSW() if self.is_hnsw else faiss.SearchParameters()
        if self.is_hnsw:
            params.efSearch = self.ef_search
        if self._dead:
            batch = faiss.IDSelectorBatch(np.asarray(self._dead, dtype=np.int64))
            selector = faiss.IDSelectorNot(batch)
            params.sel = selector
            self._selector_refs = (batch, selector)
        self._params_cache = params
        return params

    def _rebuild(self, hnsw: bool) -> None:
        live = [p for p, key in enumerate(self._keys) if key is not None]
        vectors = self._index.reconstruct_batch(np.asarray(live, dtype=np.int64)) if live else np.zeros((0, self.dim), np.float32)
        keys = [self._keys[p] for p in live]
        if hnsw:
            index = faiss.IndexHNSWFlat(self.dim, self.hnsw_m, faiss.METRIC_INNER_PRODUCT)
            index.hnsw.efConstruction = 40
        else:
            index = faiss.IndexFlatIP(self.dim)
        if len(vectors):
            index.add(np.ascontiguousarray(vectors, dtype=np.float32))
        self._index, self._keys, self._dead, self._params_cache = index, keys, [], None
        self._pos = {key: i for i, key in enumerate(keys)}
