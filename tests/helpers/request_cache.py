"""Shared by the request-cache test modules: a deterministic semantic layer, a settable clock, request builders."""
from __future__ import annotations

import asyncio
import random
import re
import threading
import zlib
from types import SimpleNamespace

import numpy as np

from strata.cache.request.request_cache import CacheRequest, RequestCache, RequestCacheConfig


class FakeSemantic:
    """Follows the SemanticCache interface: bag-of-words cosine, tiers serve >= 0.95, similar >= 0.8.
    leaky=True ignores partitions, to prove the facade itself never serves across tenants."""

    def __init__(self, leaky=False, dim=256):
        self.leaky, self.dim = leaky, dim
        self.rows: dict[str, tuple[str, str, np.ndarray]] = {}
        self.lock = threading.Lock()
        self.embeds = 0

    def embed(self, text):
        self.embeds += 1
        v = np.zeros(self.dim, np.float32)
        for w in re.findall(r"\w+", text.lower()):
            v[zlib.crc32(w.encode()) % self.dim] += 1       # deterministic, unlike hash()
        return v / max(np.linalg.norm(v), 1e-9)

    def add(self, entry_id, text, partition, embedding=None):
        emb = self.embed(text) if embedding is None else np.asarray(embedding, np.float32)
        if emb.shape != (self.dim,):
            raise ValueError("dim mismatch")
        with self.lock:
            self.rows[entry_id] = (text, partition, emb)

    def remove(self, entry_id):
        with self.lock:
            self.rows.pop(entry_id, None)

    def ids(self):
        with self.lock:
            return list(self.rows)

    def serves(self, text):
        return True

    def _scored(self, emb, partition):
        with self.lock:
            rows = list(self.rows.items())
        return sorted(((float(e @ emb), i, t) for i, (t, p, e) in rows if self.leaky or partition is None or p == partition),
                      reverse=True)

    top_k = 5

    def lookup(self, text, partition, embedding=None):
        emb = self.embed(text) if embedding is None else embedding
        return self.decide(text, [(i, sim, t) for sim, i, t in self._scored(emb, partition)])

    def candidates(self, text, partition, embedding=None):
        emb = self.embed(text) if embedding is None else embedding
        return [(i, sim, t) for sim, i, t in self._scored(emb, partition)][:self.top_k]

    def decide(self, text, candidates):
        for i, sim, t in sorted(candidates, key=lambda c: -c[1]):
            if sim >= 0.8:
                return SimpleNamespace(entry_id=i, similarity=sim, tier="serve" if sim >= 0.95 else "similar", cached_text=t)
        return None

    def min_similarity(self, text):
        return 0.8

    def similar_ids(self, text, min_similarity, partition=None):
        return [i for sim, i, _ in self._scored(self.embed(text), partition) if sim >= min_similarity]

    def __len__(self):
        return len(self.rows)


class Clock:
    def __init__(self, t=1_000_000.0):
        self.t = t

    def __call__(self):
        return self.t


def chat(text, tenant="default", model="m@1", history=(), **kw):
    sampling = kw.pop("sampling", {"temperature": 0})
    return CacheRequest(tenant, model, [*history, {"role": "user", "content": text}], sampling, **kw)


def make(tmp_path=None, semantic=None, clock=None, **cfg):
    config = RequestCacheConfig(db=str(tmp_path / "cache.db") if tmp_path else None, **cfg)
    return RequestCache(config, semantic=semantic, clock=clock or Clock(), rng=random.Random(0))


async def answer(cache, req, text="ANSWER"):
    calls = []

    async def compute():
        calls.append(1)
        return text

    got, lookup = await cache.get_or_compute(req, compute)
    await cache.drain()
    return got, lookup, len(calls)


def run(coro):
    return asyncio.run(coro)
