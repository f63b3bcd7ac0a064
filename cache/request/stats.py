"""Observability as plain data: per-layer counters, similarity and hit-age histograms, a near-threshold review ring."""
from __future__ import annotations

import bisect
import threading
from collections import Counter, deque

SIMILARITY_BOUNDS = (0.80, 0.85, 0.90, 0.92, 0.94, 0.96, 0.97, 0.98, 0.99, 1.0)
AGE_BOUNDS_S = (1.0, 10.0, 60.0, 300.0, 3600.0, 86400.0, 604800.0, 2592000.0)


class Histogram:
    """Fixed upper bounds plus an overflow bucket (Prometheus-style, non-cumulative here)."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        """Count one value in its bucket."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def snapshot(self) -> dict:
        """Plain data for /metrics and tests."""
        return {"le": [*self.bounds, "+Inf"], "counts": list(self.counts), "count": sum(self.counts), "sum": self.total}


class CacheStats:
    """Counters keyed "layer.outcome" (exact.hit, semantic.miss, bypass.realtime, write.dropped, ...)."""

    def __init__(self, review_size: int):
        self.counts: Counter[str] = Counter()
        self.similarity = Histogram(SIMILARITY_BOUNDS)
        self.hit_age = Histogram(AGE_BOUNDS_S)
        self.near_threshold: deque[dict] = deque(maxlen=review_size)
        self.lock = threading.Lock()        # the event loop and the write-back thread both count

    def count(self, name: str, n: int = 1) -> None:
        """Add n to the counter "layer.outcome"."""
        with self.lock:
            self.counts[name] += n

    def observe_hit(self, layer: str, similarity: float, age_s: float) -> None:
        """One served hit: its layer, age and (semantic layers only, for threshold tuning) similarity."""
        with self.lock:
            self.counts[f"{layer}.hit"] += 1
            if layer.startswith("semantic"):
                self.similarity.observe(similarity)
            self.hit_age.observe(age_s)

    def snapshot(self) -> dict:
        """Counters nested as {layer: {outcome: n}} plus both histograms."""
        layers: dict[str, dict[str, int]] = {}
        with self.lock:
            counts = sorted(self.counts.items())
        for name, n in counts:
            layer, _, outcome = name.partition(".")
            layers.setdefault(layer, {})[outcome] = n
        return {"counters": layers, "similarity": self.similarity.snapshot(), "hit_age_s": self.hit_age.snapshot()}
