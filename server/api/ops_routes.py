"""Operator routes: health, Prometheus metrics, the status page and its JSON."""
from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Depends
from fastapi.responses import FileResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from strata.cache.request.request_cache import RequestCache
from strata.server.api.auth import Auth
from strata.server.api.errors import APIError
from strata.server.api.metrics import Metrics
from strata.server.engine.engine_client import EngineClient

STATIC = Path(__file__).with_name("static")


def ops_router(auth: Auth, engine: EngineClient, metrics: Metrics, cache: RequestCache | None,
               stall_s: float = 120.0) -> APIRouter:
    """The status page's HTML and script are public (they hold no data); /status and /metrics carry traffic data
    and take the admin token when API keys are on (Auth.check_ops)."""
    router = APIRouter()
    ops = [Depends(auth.check_ops)]

    def health_state() -> tuple[str, str | None]:
        """ok | degraded (serving, with a fault worth a look) | starting | failed, and a short reason."""
        state, reason = engine.state, engine.reason
        stalled = engine.stalled_for()
        if state == "ok" and stalled >= stall_s:
            state, reason = "degraded", (f"the engine has reported no step for {stalled:.0f} s while "
                                         f"{engine.num_pending} request(s) wait on it")
        if state == "ok" and cache is not None:
            cache_health = cache.health()
            if cache_health["status"] != "ok":
                state, reason = "degraded", f"request cache: {cache_health['reason']}"
        return state, reason or None

    @router.get("/health")
    async def health():
        """The state, 503 while it cannot serve. A short reason only: the details are in the server log."""
        state, reason = health_state()
        body = {"status": state, "pending": engine.num_pending, "engine_restarts": engine.restarts}
        if reason:
            body["reason"] = reason
        if state in ("ok", "degraded"):
            return body
        retry = engine.retry_after_s()
        return JSONResponse(body, status_code=503, headers={"Retry-After": str(round(retry))} if retry else None)

    router.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)   # probes that send HEAD

    @router.get("/metrics", dependencies=ops)
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @router.get("/status", dependencies=ops)
    async def status():
        state, reason = health_state()       # what /health says, so that the page never shows green over a fault
        return metrics.status() | {"pending": engine.num_pending, "request_cache": cache is not None,
                                   "health": {"status": state, "reason": reason, "engine_restarts": engine.restarts}}

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
