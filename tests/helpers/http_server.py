"""Shared by the HTTP test modules: one uvicorn server per module, each with an engine process that builds its
engine from ENGINE (no tests here).

Semantic layers: the shipped one (real embedder, cross-encoder, tiers certified for an error bound) for the end-to-end
module;
the "hash" test embedder with fixed thresholds where a test needs a given tier (semantic vs semantic-similar).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import openai
import torch

from strata.cache.request.calibration import Tiers
from strata.cache.request.embedders import HashEmbedder
from strata.cache.request.request_cache import RequestCache, RequestCacheConfig
from strata.cache.request.semantic import SemanticCache
from strata.server.api.app import create_app
from strata.server.api.auth import Auth
from strata.server.api.config import ServerConfig
from strata.server.api.server import serve_in_thread
from strata.server.engine.config import EngineConfig
from strata.server.engine.engine_client import EngineClient, RestartPolicy
from strata.server.engine.input_processor import InputProcessor

KEYS = {"key-acme": "acme", "key-globex": "globex"}
ADMIN = "admin-secret"
MODEL = "SmolLM2-135M-Instruct"
ENGINE = EngineConfig(dtype="fp32", kv_cache_memory="256MiB")      # the real default model


@dataclass(slots=True)
class Server:
    url: str
    app: object
    inputs: InputProcessor      # what the HTTP process validates with: tokenizer and the model's limits
    cache: RequestCache
    idle: int = 0            # KV blocks in use with no request running

    @property
    def model(self) -> str:
        return self.inputs.info.model_id

    def stats(self) -> dict[str, float]:
        """The engine's counters as the engine process last reported them (what /metrics reads)."""
        return self.app.state.completer.engine.stats()

    def settle(self) -> None:
        """Wait for the background write-back, so the next identical request can hit."""
        asyncio.run(self.cache.drain())

    def idle_blocks(self, expected: int, timeout: float = 10.0) -> int:
        """Poll until no sequence holds KV blocks (aborts land in the engine process a moment later)."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            idle = stats["num_running"] + stats["num_waiting"] + stats["num_swapped"] == 0
            if stats["kv_blocks_used"] == expected and idle or time.monotonic() > deadline:
                return stats["kv_blocks_used"]
            time.sleep(0.05)

    def http(self, key: str | None = "key-acme") -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=120)


def default_semantic(max_error: float | None = None) -> SemanticCache:
    """The shipped semantic layer; max_error: a looser bound than the default (--semantic-max-error)."""
    config = RequestCacheConfig()
    if max_error is not None:
        config.semantic_max_error = max_error
    return SemanticCache.from_config(config)


def hash_semantic() -> SemanticCache:
    """Deterministic tiers: cosine >= 0.95 serves, >= 0.85 serves with the similar-question note."""
    return SemanticCache(HashEmbedder(), Tiers(serve=0.95, similar=0.85))


FAST_RESTART = RestartPolicy(max_restarts=3, window_s=300, backoff_s=0.2, max_backoff_s=1.0)


@contextmanager
def start_server(semantic: SemanticCache, config: ServerConfig | None = None, num_threads: int = 1,
                 restart: RestartPolicy = FAST_RESTART, engine: EngineConfig = ENGINE,
                 cache: RequestCacheConfig | None = None) -> Iterator[Server]:
    """One torch thread (for the engine process) by default, restored after: on 2 shared cores, 2 spinning OpenMP
    threads made an 8-token answer ~5x slower than 1 thread, and the HTTP event loop needs a core too.
    cache: the request cache's config (default: in memory; --cache-redis replicas pass theirs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        with _serve(semantic, config, restart, engine, cache or RequestCacheConfig()) as server:
            yield server
    finally:
        torch.set_num_threads(threads)


@contextmanager
def _serve(semantic: SemanticCache, config: ServerConfig | None, restart: RestartPolicy,
           engine_config: EngineConfig, cache_config: RequestCacheConfig) -> Iterator[Server]:
    engine = EngineClient(engine_config, restart)
    engine.start()
    try:
        inputs = engine.wait_ready()
        cache = RequestCache(cache_config, semantic=semantic)
        app = create_app(engine, cache, auth=Auth(dict(KEYS), ADMIN), config=config or ServerConfig())
        with serve_in_thread(app) as url:
            yield Server(url, app, inputs, cache)
    finally:
        engine.stop()        # the app's shutdown stopped it already, unless the server never started


def client(server: Server, key: str = "key-acme") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


def ask(server: Server, question: str, key: str = "key-acme", **extra):
    """One greedy chat request; returns (layer header, similarity header, parsed completion)."""
    raw = client(server, key).chat.completions.with_raw_response.create(
        model=server.model, messages=[{"role": "user", "content": question}], max_tokens=8, temperature=0, **extra)
    return raw.headers["x-strata-cache"], raw.headers.get("x-strata-similarity"), raw.parse()


def admin(server: Server, path: str, **kwargs) -> httpx.Response:
    """An admin call: POST when it carries a body, else GET."""
    with server.http(ADMIN) as http:
        return http.request("POST" if "json" in kwargs or "content" in kwargs else "GET", path, **kwargs)
