"""The HTTP server's configuration: listening, auth, limits, and the request cache it puts in front of the engine."""
from __future__ import annotations

from dataclasses import dataclass, field

from strata.cache.request.config import RequestCacheConfig, check_seconds

DEFAULT_CACHE_DB = ".strata/request_cache.db"


def _served_cache() -> RequestCacheConfig:
    """A server keeps its answers across restarts by default; a library RequestCache lives in memory."""
    return RequestCacheConfig(db=DEFAULT_CACHE_DB)


@dataclass(slots=True)
class ServerConfig:
    """Everything `strata serve` sets apart from the engine; its flags are generated from these fields."""

    host: str = "127.0.0.1"  # address to listen on
    port: int = 8000  # port to listen on
    api_keys: str | None = None  # file of '<api-key> <tenant>' lines; none = auth off (every caller is "default")
    admin_token: str | None = field(
        default=None, metadata={"envvar": "STRATA_ADMIN_TOKEN"})  # bearer token for /admin/cache/*; none = admin off
    public_metrics: bool = False  # /metrics and /status without the admin token even when --api-keys is set
    max_queue: int = 256  # requests inside the engine (running + waiting) before new misses get 503 + Retry-After
    max_body_bytes: int = 1 << 20  # larger request bodies get 413
    default_max_tokens: int = 256  # max_tokens when a request names none (capped by the context left)
    similar_note: bool = True  # prefix semantic-similar answers with a visible note
    access_log: bool = True  # one log line per request (uvicorn's access log)
    engine_restarts: int = 3  # engine process deaths tolerated within --engine-restart-window-s; one more exits 1
    engine_restart_window_s: float = 300.0  # the window those deaths are counted in
    shutdown_timeout_s: float = 30.0  # on SIGTERM / Ctrl-C, requests in flight get this long to finish, then are cut
    engine_start_timeout_s: float = 600.0  # how long a start (or restart) may load the model, convert it on first use and build the CPU kernels before it fails
    engine_stall_s: float = 120.0  # /health says degraded when the engine reports no step for this long while requests wait on it (stopped, wedged, or a step far slower than usual)
    engine_stall_restart_s: float = 600.0  # an engine that reports no step for this long while requests wait on it is killed and restarted (a death within --engine-restarts; the waiting requests get 503); 0 = never
    request_cache: bool = True  # exact + semantic request caches in front of the engine
    cache: RequestCacheConfig = field(default_factory=_served_cache)

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        if self.max_queue < 1 or self.max_body_bytes < 1 or self.default_max_tokens < 1:
            raise ValueError("max_queue, max_body_bytes and default_max_tokens must be >= 1")
        check_seconds(self, positive=("engine_stall_s", "engine_start_timeout_s"),
                      non_negative=("shutdown_timeout_s", "engine_stall_restart_s"))
        if self.engine_restarts < 0 or not 0.0 < self.engine_restart_window_s < float("inf"):
            raise ValueError("engine_restarts must be >= 0 and engine_restart_window_s finite and > 0")
