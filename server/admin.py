"""Admin routes for the request cache (invalidate, stats, review, warm-up), behind the admin token."""
from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from strata.server.auth import DEFAULT_TENANT, Auth
from strata.server.body import read_body
from strata.server.http_errors import APIError
from strata.server.serving import Completer, cache_sampling


class InvalidateRequest(BaseModel):
    """All given filters must match; `similar_to` deletes entries whose question is that close to this text."""

    model_config = ConfigDict(extra="forbid")

    id: str | None = None
    tag: str | None = None
    partition: str | None = None
    model: str | None = None
    tenant: str | None = None
    similar_to: str | None = None
    min_similarity: float = Field(default=0.9, gt=0.0, le=1.0)


def admin_router(auth: Auth, completer: Completer, max_body_bytes: int) -> APIRouter:
    router = APIRouter(prefix="/admin/cache", dependencies=[Depends(auth.check_admin)])

    def cache():
        if completer.cache is None:
            raise APIError(400, "the request cache is off on this server (--no-request-cache)")
        return completer.cache

    @router.post("/invalidate")
    async def invalidate(body: InvalidateRequest):
        try:
            deleted = cache().invalidate(entry_id=body.id, tag=body.tag, partition=body.partition, model=body.model,
                                         tenant=body.tenant, similar_to=body.similar_to,
                                         min_similarity=body.min_similarity)
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
        return {"deleted": deleted}

    @router.get("/stats")
    async def stats():
        return {"model": completer.model_key, "request_cache": cache().stats(), "engine": completer.aengine.stats()}

    @router.get("/review")
    async def review(limit: int = Query(50, ge=0, le=1000)):
        return {"data": cache().review(limit)}

    @router.post("/warmup")
    async def warmup(request: Request, tenant: str = DEFAULT_TENANT, temperature: float = 0.0,
                     max_tokens: int | None = None):
        """Body: JSONL lines {"question", "answer", "tags"?, "ttl_class"?}, keyed like a chat request with these
        sampling settings (a request with other max_tokens or temperature lives in another partition)."""
        body = await read_body(request, max_body_bytes * 16)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "warmup.jsonl"
            path.write_bytes(body)
            try:
                written = await asyncio.to_thread(cache().warmup, path, tenant=tenant, model=completer.model_key,
                                                  sampling=cache_sampling(temperature, max_tokens=max_tokens))
            except ValueError as exc:
                raise APIError(400, str(exc).replace(str(path), "body")) from None
        return {"written": written}

    return router
