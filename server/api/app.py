"""The FastAPI app: the exact + semantic request caches in front of the engine, which steps in a process of its own
(server/engine/engine_client.py) so that model steps never hold this process's GIL."""
from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI

from strata.cache.request.request_cache import RequestCache
from strata.server.api import errors
from strata.server.api.admin import admin_router
from strata.server.api.auth import Auth
from strata.server.api.config import ServerConfig
from strata.server.api.metrics import Metrics
from strata.server.api.openai_routes import openai_router
from strata.server.api.ops_routes import ops_router
from strata.server.api.serving import Completer
from strata.server.api.tokenize_routes import tokenize_router
from strata.server.engine.engine_client import EngineClient


def create_app(engine: EngineClient, cache: RequestCache | None = None, *, auth: Auth | None = None,
               config: ServerConfig | None = None) -> FastAPI:
    """An app serving a ready engine process (its `wait_ready` returned) behind `cache`; the app's shutdown stops
    the engine process and closes the cache, so one engine process serves one app."""
    auth = auth or Auth()
    config = config or ServerConfig()
    completer = Completer(engine, cache, config)
    metrics = Metrics(engine.stats, cache, completer.model_key, lambda: (engine.state, engine.restarts))

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        try:
            yield
        finally:
            engine.stop()
            if cache is not None:
                cache.close()

    app = FastAPI(title="Strata", lifespan=lifespan)
    app.state.completer, app.state.metrics, app.state.config = completer, metrics, config
    errors.install(app)
    app.include_router(openai_router(auth, completer, metrics, config.max_body_bytes))
    app.include_router(tokenize_router(auth, completer, config.max_body_bytes))
    app.include_router(admin_router(auth, completer, config.max_body_bytes))
    app.include_router(ops_router(auth, engine, metrics, cache, config.engine_stall_s))
    return app
