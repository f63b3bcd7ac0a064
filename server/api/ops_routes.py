"""Operator routes: health, Prometheus metrics, the status page and its JSON."""
from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from strata.server.api.errors import APIError
from strata.server.api.metrics import Metrics
from strata.server.engine.engine_client import EngineClient

STATIC = Path(__file__).with_name("static")


def ops_router(engine: EngineClient, metrics: Metrics, request_cache: bool) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health():
        if not engine.alive:
            raise APIError(503, f"engine process stopped: {engine.error!r}", code="engine_dead")
        return {"status": "ok", "pending": engine.num_pending}

    @router.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @router.get("/status")
    async def status():
        return metrics.status() | {"pending": engine.num_pending, "request_cache": request_cache}

    @router.get("/")
    async def status_page():
        return FileResponse(STATIC / "index.html")

    @router.get("/static/{name}")
    async def static(name: str):
        path = STATIC / name
        if path.parent != STATIC or not path.is_file():
            raise APIError(404, f"no static file {name!r}")
        return FileResponse(path)

    return router
