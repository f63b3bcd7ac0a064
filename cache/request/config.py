"""One configuration object for the whole request cache (exact + semantic layers)."""
from __future__ import annotations

from dataclasses import dataclass, field

from strata.cache.request.embedders import EMBEDDERS  # numpy only: the models load on first use

TEMPERATURE_RULES = ("seeded-exact", "exact", "bypass")


@dataclass(slots=True)
class RequestCacheConfig:
    """Every request-cache knob in one place, so the server can build it from CLI flags or a file."""

    # stores
    db: str | None = None  # SQLite file of stored answers (WAL); none = in memory, nothing survives a restart
    db_reset: bool = False  # a corrupt db file is moved aside (<file>.corrupt-<time>) and the cache starts empty
    max_bytes: int = 2**30  # store bound, bytes of stored entries (texts, answer, embedding): LRU eviction keeps it
    tenant_max_share: float = 1.0  # a tenant may hold at most this fraction of max_bytes (1 = the global bound only)
    memory_max_entries: int = 50_000  # in-process exact layer (in front of the store) bound, entries
    memory_max_bytes: int = 256 * 2**20  # in-process exact layer (in front of the store) bound, bytes
    # shared store for many replicas (cache/request/redis_store.py); without it the SQLite store above
    redis: str | None = None  # Redis/Valkey >= 7 shared by replicas: redis://, rediss:// or unix:// URL; none = SQLite
    redis_timeout_s: float = 0.25  # a Redis call slower than this fails; the request goes on from the in-process layer
    redis_queue_size: int = 10_000  # writes kept while Redis is down, flushed on recovery; past it the oldest drop
    redis_stream_len: int = 100_000  # sync events kept in Redis (approx.); a replica further behind rebuilds its index
    lease_s: float = 30.0  # cross-replica single-flight: a miss holds its question (SET NX PX) this long at most
    lease_wait_s: float = 5.0  # a replica that finds the question held waits this long for the answer, then computes
    # keys and policy
    casefold: bool = False  # fold case in the exact key ("Paris" == "paris")
    policy_rules: str | None = None  # JSON rules file; none = the shipped data/policy_rules.json
    ttl_jitter: float = 0.1  # TTL is multiplied by uniform(1 - j, 1 + j) against expiry avalanches
    default_temperature: float = 1.0  # what an absent "temperature" means
    temperature_rule: str = "seeded-exact"  # temperature > 0: seeded-exact | exact | bypass (see policy.py)
    # write-back, single-flight, penetration guard
    write_queue_size: int = 1024  # background write queue; a full queue drops the write
    follow_timeout_s: float = 120.0  # a follower waits this long for its leader, then computes itself
    negative_ttl_s: float = 2.0  # a failed computation is remembered this long (same request gets the error)
    miss_window_s: float = 10.0  # penetration guard: window for near-identical misses from one client
    miss_limit: int = 3  # misses of one cluster per client and window before the guard marks it
    # semantic layer (cache/request/semantic.py; per-embedder thresholds in data/semantic_thresholds.json)
    embedder: str = "auto"  # auto (= e5-small, multilingual) | e5-small | minilm | use-multilingual | hash | none
    second_stage: bool = True  # read the closest candidates together with the question (cross-encoder) before serving
    semantic_max_error: float = field(
        default=0.02, metadata={"aliases": ("--semantic-max-error",)})  # bound on false semantic hits (95% upper)
    semantic_calibration: str | None = field(
        default=None, metadata={"aliases": ("--semantic-calibration",)})  # `strata calibrate` file; none = shipped
    semantic_top_k: int = 5  # candidates per lookup (same partition only)
    semantic_rerank: int = 1  # of those, how many the second stage reads at most (each costs a model pass)
    hnsw_min_size: int = 10_000  # a partition's exact IndexFlatIP becomes HNSW at this many entries
    embed_cache_size: int = 4096  # LRU of recent embeddings (a request is embedded once)
    # observability
    review_size: int = 200  # ring of near-threshold semantic hits kept for human review
    review_below: float = 0.985  # a semantic hit under this similarity goes to the review ring

    @property
    def semantic(self) -> bool:
        """Whether the semantic layer is on (embedder "none" keeps the exact layer only)."""
        return self.embedder != "none"

    def __post_init__(self) -> None:
        if self.memory_max_entries < 1 or self.memory_max_bytes < 1 or self.max_bytes < 1:
            raise ValueError("memory_max_entries, memory_max_bytes and max_bytes must be >= 1")
        if not 0.0 < self.tenant_max_share <= 1.0:
            raise ValueError(f"tenant_max_share must be in (0, 1], got {self.tenant_max_share}")
        if not 0.0 <= self.ttl_jitter < 1.0:
            raise ValueError(f"ttl_jitter must be in [0, 1), got {self.ttl_jitter}")
        if self.temperature_rule not in TEMPERATURE_RULES:
            raise ValueError(f"temperature_rule must be one of {TEMPERATURE_RULES}, got {self.temperature_rule!r}")
        if self.redis_queue_size < 1 or self.redis_stream_len < 1:
            raise ValueError("redis_queue_size and redis_stream_len must be >= 1")
        check_seconds(self, positive=("redis_timeout_s", "lease_s", "follow_timeout_s", "miss_window_s"),
                      non_negative=("lease_wait_s", "negative_ttl_s"))
        if not 0.0 <= self.default_temperature <= 2.0:
            raise ValueError(f"default_temperature must be in [0, 2] as a request's, got {self.default_temperature}")
        if self.review_size < 0 or not -1.0 <= self.review_below <= 1.0:
            raise ValueError("review_size must be >= 0 and review_below a similarity in [-1, 1]")
        if self.write_queue_size < 1:
            raise ValueError("write_queue_size must be >= 1")
        if self.miss_limit < 1:
            raise ValueError("miss_limit must be >= 1")
        if self.embedder not in (*EMBEDDERS, "auto", "none"):      # a typo served exact-only with a warning
            raise ValueError(f"embedder {self.embedder!r} is unknown; choose one of "
                             f"{sorted(EMBEDDERS) + ['auto', 'none']}")
        if self.semantic_top_k < 1 or self.semantic_rerank < 1 or self.hnsw_min_size < 1 or self.embed_cache_size < 1:
            raise ValueError("semantic_top_k, semantic_rerank, hnsw_min_size and embed_cache_size must be >= 1")
        if not 0.0 < self.semantic_max_error < 1.0:
            raise ValueError(f"semantic_max_error must be in (0, 1), got {self.semantic_max_error}")
        if self.semantic_calibration and not self.semantic:    # the operator's file would silently go unread
            raise ValueError("semantic_calibration is for the semantic layer, which embedder 'none' turns off")


def check_seconds(config: object, positive: tuple[str, ...] = (), non_negative: tuple[str, ...] = ()) -> None:
    """Durations of a config: finite, and > 0 (or >= 0). Written as ranges, so NaN fails too (NaN <= 0 is False)."""
    for names, zero_ok in ((positive, False), (non_negative, True)):
        for name in names:
            value = getattr(config, name)
            above_zero = value >= 0.0 if zero_ok else value > 0.0
            if not (above_zero and value < float("inf")):
                raise ValueError(f"{name} must be a finite number of seconds {'>=' if zero_ok else '>'} 0, got {value}")
