"""Prometheus metrics on a per-app registry: request counters and latencies by cache layer, plus engine and
request-cache state read at scrape time (so /metrics and the status page never drift from the source)."""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from strata.server.api.serving import Answer

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2.5)
RATE_WINDOW_S = 10.0
TIERS = {"exact": "exact", "shared": "shared", "semantic": "serve", "semantic-similar": "similar"}


class Metrics:
    """Everything /metrics, /status and the load benchmark report, on a registry owned by one app."""

    def __init__(self, engine_stats: Callable[[], dict], cache, model_key: str,
                 engine_state: Callable[[], tuple[str, int]] = lambda: ("ok", 0)):
        """engine_stats: the engine's counters (EngineClient.stats, the engine process's latest snapshot);
        engine_state: its supervisor's state (ok | starting | failed | stopped) and restarts so far."""
        self.engine_stats, self.cache, self.model_key = engine_stats, cache, model_key
        self.engine_state = engine_state
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("strata_requests", "Completion choices (one per prompt and n) by endpoint, cache "
                                "layer and HTTP status", ["endpoint", "cache_layer", "status"], registry=registry)
        self.latency = Histogram("strata_request_latency_seconds", "Request latency to the last byte, by cache layer",
                                 ["cache_layer"], buckets=LATENCY_BUCKETS, registry=registry)
        self.ttft = Histogram("strata_time_to_first_token_seconds", "Time to the first answer text, by cache layer",
                              ["cache_layer"], buckets=LATENCY_BUCKETS, registry=registry)
        self.tpot = Histogram("strata_time_per_output_token_seconds", "Decode time per output token (engine answers)",
                              buckets=TPOT_BUCKETS, registry=registry)
        self.output_tokens = Counter("strata_output_tokens", "Completion tokens sent, by cache layer",
                                     ["cache_layer"], registry=registry)
        self.recent: deque[dict] = deque(maxlen=50)
        self.window: deque[tuple[float, str, int]] = deque()    # (finish time, source, tokens) for tokens/s
        registry.register(_StateCollector(self))

    def observe(self, endpoint: str, answer: Answer, status: int = 200) -> None:
        """One finished (or abandoned, status 499) answer; one that failed (4xx / 5xx) counts as an error, outside the
        layer's latency and token figures."""
        now = time.perf_counter()
        latency = now - answer.started
        failed = status >= 400 and status != 499
        layer = "error" if failed else answer.layer
        self.requests.labels(endpoint, layer, str(status)).inc()
        if not failed:
            self.latency.labels(layer).observe(latency)
            if answer.ttft_s is not None:
                self.ttft.labels(layer).observe(answer.ttft_s)
            cached = layer in TIERS
            if not cached and answer.completion_tokens > 1 and answer.ttft_s is not None:
                self.tpot.observe((latency - answer.ttft_s) / (answer.completion_tokens - 1))
            self.output_tokens.labels(layer).inc(answer.completion_tokens)
            self.window.append((now, "cache" if cached else "engine", answer.completion_tokens))
        self.recent.append({"time": time.time(), "endpoint": endpoint, "cache": layer, "status": status,
                            "similarity": None if failed else answer.similarity,
                            "latency_ms": round(latency * 1000, 2), "tokens": 0 if failed else answer.completion_tokens})

    def observe_error(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, "error", str(status)).inc()

    def tokens_per_second(self) -> dict[str, float]:
        """Completion tokens per second over the last RATE_WINDOW_S, by source (engine or cache)."""
        cutoff = time.perf_counter() - RATE_WINDOW_S
        while self.window and self.window[0][0] < cutoff:
            self.window.popleft()
        rate = {"engine": 0.0, "cache": 0.0}
        for _, source, n in self.window:
            rate[source] += n / RATE_WINDOW_S
        return rate

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def status(self) -> dict:
        """What the status page shows: KV usage, answers by layer, similarity histogram, recent requests."""
        kv = self.engine_stats()
        by_layer: dict[str, float] = {}
        for sample in self.requests.collect()[0].samples:
            if sample.name.endswith("_total") and sample.labels["cache_layer"] != "error":
                layer = sample.labels["cache_layer"]
                by_layer[layer] = by_layer.get(layer, 0) + sample.value
        total = sum(by_layer.values())
        cache = self.cache.stats() if self.cache is not None else None
        return {"model": self.model_key,
                "kv": {k: kv[f"kv_blocks_{k}"] for k in ("used", "free", "cached", "total")},
                "engine": {k: kv[k] for k in ("num_running", "num_waiting", "num_swapped", "preemptions_swap",
                                              "preemptions_recompute", "prefix_cache_hits", "prefix_cache_queries")},
                "tokens_per_second": self.tokens_per_second(),
                "requests": {"total": total, "by_layer": by_layer,
                             "share": {k: v / total for k, v in by_layer.items()} if total else {}},
                "similarity": cache["similarity"] if cache else None,
                "recent": list(reversed(self.recent))[:20]}


class _StateCollector:
    """Engine and request-cache counters as metric families, read from their stats() at scrape time."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def collect(self):
        m = self.metrics
        state, restarts = m.engine_state()
        # the counters below are the latest snapshot: stale while the engine is down, from 0 again after a restart
        yield GaugeMetricFamily("strata_engine_up", "1 while the engine process takes requests, 0 while it starts, "
                                "restarts or has failed", value=float(state == "ok"))
        yield CounterMetricFamily("strata_engine_restarts", "Engine process restarts after it died",
                                  value=restarts)
        kv = m.engine_stats()
        blocks = GaugeMetricFamily("strata_kv_blocks", "KV cache blocks by state", labels=["state"])
        for state in ("used", "free", "cached", "total"):
            blocks.add_metric([state], kv[f"kv_blocks_{state}"])
        yield blocks
        swap = CounterMetricFamily("strata_kv_swap_blocks", "KV blocks swapped to/from CPU", labels=["direction"])
        swap.add_metric(["out"], kv["swap_out_blocks"])
        swap.add_metric(["in"], kv["swap_in_blocks"])
        yield swap
        pre = CounterMetricFamily("strata_preemptions", "Sequences preempted, by mode", labels=["mode"])
        pre.add_metric(["swap"], kv["preemptions_swap"])
        pre.add_metric(["recompute"], kv["preemptions_recompute"])
        yield pre
        yield CounterMetricFamily("strata_prefix_cache_queries", "Prefix-cache lookups", value=kv["prefix_cache_queries"])
        yield CounterMetricFamily("strata_prefix_cache_hits", "Prefix-cache lookups that reused blocks",
                                  value=kv["prefix_cache_hits"])
        yield CounterMetricFamily("strata_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
                                  value=kv["prefix_cache_hit_tokens"])
        yield CounterMetricFamily("strata_engine_generated_tokens", "Tokens the engine generated",
                                  value=kv["generated_tokens"])
        seqs = GaugeMetricFamily("strata_engine_sequences", "Sequences in the engine by state", labels=["state"])
        for state in ("running", "waiting", "swapped"):
            seqs.add_metric([state], kv[f"num_{state}"])
        yield seqs
        yield from _spec_families(kv)
        rate = GaugeMetricFamily("strata_tokens_per_second", f"Completion tokens/s over {RATE_WINDOW_S:.0f} s",
                                 labels=["source"])
        for source, value in m.tokens_per_second().items():
            rate.add_metric([source], value)
        yield rate
        if m.cache is not None:
            yield from _cache_families(m.cache.stats())


SPEC_COUNTERS = {"drafts": "Verify steps that carried a speculative draft",
                 "proposed_tokens": "Draft tokens proposed",
                 "accepted_tokens": "Draft tokens the model accepted",
                 "steps_saved": "Decode steps saved by accepted draft tokens"}


def _spec_families(kv: dict):
    """Speculative decoding counters by draft source (engine stats spec_<source>_<counter>; none when it is off)."""
    for name, doc in SPEC_COUNTERS.items():
        family = CounterMetricFamily(f"strata_spec_{name}", doc, labels=["source"])
        for source in ("ngram", "cache"):
            if f"spec_{source}_{name}" in kv:
                family.add_metric([source], kv[f"spec_{source}_{name}"])
        yield family


def _cache_families(stats: dict):
    counters = stats["counters"]
    hits = CounterMetricFamily("strata_request_cache_hits", "Request-cache hits by layer and tier",
                               labels=["layer", "tier"])
    for layer, tier in TIERS.items():
        hits.add_metric([layer, tier], counters.get(layer, {}).get("hit", 0))
    yield hits
    lookups = CounterMetricFamily("strata_request_cache_lookups", "Request-cache lookups by layer and outcome",
                                  labels=["layer", "outcome"])
    for layer in ("exact", "semantic"):
        for outcome, n in counters.get(layer, {}).items():
            lookups.add_metric([layer, outcome], n)
    yield lookups
    for name, doc, key, label in (("bypass", "Requests that skipped the request cache", "bypass", "reason"),
                                  ("writes", "Write-back outcomes", "write", "outcome"),
                                  ("single_flight", "Single-flight waits", "single_flight", "outcome")):
        family = CounterMetricFamily(f"strata_request_cache_{name}", doc, labels=[label])
        for value, n in counters.get(key, {}).items():
            family.add_metric([value], n)
        yield family
    store = counters.get("store", {})
    yield CounterMetricFamily("strata_cache_store_errors", "Request-cache store operations that failed (served as "
                              "misses)", value=store.get("error", 0))
    yield CounterMetricFamily("strata_cache_store_damaged", "Stored answers dropped because their content no longer "
                              "matched its checksum (never served)", value=store.get("damaged", 0))
    evicted = CounterMetricFamily("strata_cache_store_evictions", "Entries evicted to keep the store within its "
                                  "bounds", labels=["reason"])
    for reason in ("expired", "tenant_lru", "lru"):
        evicted.add_metric([reason], store.get(f"evicted_{reason}", 0))
    yield evicted
    used = stats.get("store_bytes", {})
    store_bytes = GaugeMetricFamily("strata_cache_store_bytes", "Bytes of stored answers, by tenant", labels=["tenant"])
    for tenant, n in used.get("tenants", {}).items():
        store_bytes.add_metric([tenant], n)
    yield store_bytes
    if "max" in used:
        yield GaugeMetricFamily("strata_cache_store_max_bytes", "The store's byte bound (--cache-max-bytes)",
                                value=used["max"])
    languages = stats.get("semantic", {}).get("languages", {})
    if languages:
        served = GaugeMetricFamily("strata_semantic_language_served", "1 when the error bound certified semantic hits "
                                   "for a language (--semantic-max-error), else 0", labels=["language"])
        cut = GaugeMetricFamily("strata_semantic_threshold", "Certified second-stage score threshold per language and "
                                "tier", labels=["language", "tier"])
        for lang, what in languages.items():
            served.add_metric([lang], float(what.get("similar") is not None))
            for tier in ("serve", "similar"):
                if what.get(tier) is not None:
                    cut.add_metric([lang, tier], what[tier])
        yield served
        yield cut
    redis = stats.get("redis")
    if redis is not None:
        yield GaugeMetricFamily("strata_cache_redis_up", "1 while the shared Redis store answers (--cache-redis), 0 "
                                "while the replica serves from its in-process layer", value=float(redis["up"]))
        yield CounterMetricFamily("strata_cache_redis_errors", "Redis connection errors and timeouts",
                                  value=redis["errors"])
        yield GaugeMetricFamily("strata_cache_redis_queue_depth", "Writes queued while Redis is down",
                                value=redis["queue"])
        yield CounterMetricFamily("strata_cache_redis_queue_dropped", "Queued writes dropped (oldest first) while "
                                  "Redis was down", value=redis["dropped"])
        yield CounterMetricFamily("strata_cache_redis_malformed_entries", "Entries an index rebuild skipped because "
                                  "their Redis hash could not be read (a lookup of one is a miss)",
                                  value=redis["malformed"])
        yield GaugeMetricFamily("strata_cache_redis_stream_lag_seconds", "Age of the latest sync event when this "
                                "replica read it", value=redis["stream_lag_s"])
        yield CounterMetricFamily("strata_cache_redis_resyncs", "Index rebuilds from Redis (start, recovery, gap)",
                                  value=redis["resyncs"])
    entries = GaugeMetricFamily("strata_request_cache_entries", "Stored answers by tier", labels=["tier"])
    for tier, n in stats["entries"].items():
        entries.add_metric([tier], n)
    yield entries
    sim = stats["similarity"]
    buckets, running = [], 0
    for bound, n in zip(sim["le"], sim["counts"], strict=True):
        running += n
        buckets.append((str(bound), running))
    yield HistogramMetricFamily("strata_request_cache_similarity", "Similarity of served request-cache hits",
                                buckets=buckets, sum_value=sim["sum"])
