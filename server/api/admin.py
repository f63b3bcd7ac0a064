"""Admin routes for the request cache (invalidate, stats, review, warm-up), behind the admin token."""
from __future__ import annotations

import asyncio
import json

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from strata.server.api.auth import DEFAULT_TENANT, Auth
from strata.server.api.body import read_body
from strata.server.api.errors import APIError
from strata.server.api.serving import Completer, cache_sampling


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


def _jsonl_records(body: bytes) -> list[dict]:
    """One JSON object per non-blank line; ValueError naming the line otherwise."""
    records = []
    for n, line in enumerate(body.decode("utf-8", errors="strict").splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except ValueError as exc:
                raise ValueError(f"line {n}: {exc}") from None
    return records


def admin_router(auth: Auth, completer: Completer, max_body_bytes: int) -> APIRouter:
    router = APIRouter(prefix="/admin/cache", dependencies=[Depends(auth.check_admin)])

    def cache():
        if completer.cache is None:
            raise APIError(400, "the request cache is off on this server (--no-request-cache)")
        return completer.cache

    @router.post("/invalidate")
    async def invalidate(body: InvalidateRequest):
        """Embeds (similar_to) and deletes from the store: in a worker thread, never on the event loop."""
        try:
            deleted = await asyncio.to_thread(
                cache().invalidate, entry_id=body.id, tag=body.tag, partition=body.partition, model=body.model,
                tenant=body.tenant, similar_to=body.similar_to, min_similarity=body.min_similarity)
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
        return {"deleted": deleted}

    @router.get("/stats")
    async def stats():
        return {"model": completer.model_key, "request_cache": cache().stats(), "engine": completer.engine.stats()}

    @router.get("/review")
    async def review(limit: int = Query(50, ge=0, le=1000)):
        return {"data": cache().review(limit)}

    @router.post("/warmup")
    async def warmup(request: Request, tenant: str = DEFAULT_TENANT, temperature: float = 0.0,
                     max_tokens: int | None = None):
        """Body: JSONL lines {"question", "answer", "tags"?, "ttl_class"?}, keyed like a chat request with these
        sampling settings (a request with other max_tokens or temperature lives in another partition)."""
        body = await read_body(request, max_body_bytes * 16)
        target = cache()
        sampling = cache_sampling(temperature, max_tokens=max_tokens)

        def parse_and_write() -> int:      # parsing megabytes and embedding: in a worker thread
            return target.warmup(_jsonl_records(body), tenant=tenant, model=completer.model_key, sampling=sampling)

        try:
            written = await asyncio.to_thread(parse_and_write)
        except ValueError as exc:
            raise APIError(400, f"warm-up body: {exc}") from None
        return {"written": written}

    return router
