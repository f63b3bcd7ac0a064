"""Admin routes for the request cache (invalidate, stats, review, warm-up), behind the admin token."""
from __future__ import annotations

import asyncio
import json

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from strata.cache.request.request_cache import WarmupIncomplete
from strata.server.api.auth import DEFAULT_TENANT, Auth
from strata.server.api.body import MAX_DEPTH, check_values, parse_body, read_body
from strata.server.api.errors import APIError
from strata.server.api.protocol import openapi_body
from strata.server.api.serving import Completer, cache_sampling

MAX_QUESTION_CHARS = 4096   # similar_to is embedded window by window: a question, not a document


class InvalidateRequest(BaseModel):
    """All given filters must match; `similar_to` deletes entries whose question is that close to this text."""

    model_config = ConfigDict(extra="forbid")

    id: str | None = None
    tag: str | None = None
    partition: str | None = None
    model: str | None = None
    tenant: str | None = None
    similar_to: str | None = Field(default=None, max_length=MAX_QUESTION_CHARS)
    min_similarity: float = Field(default=0.9, gt=0.0, le=1.0)


def _jsonl_records(body: bytes) -> list[dict]:
    """One JSON object per non-blank line; ValueError naming the line otherwise (APIError for text no request may
    hold: lone surrogates, nesting past body.MAX_DEPTH)."""
    records = []
    # "\n" only (a "\r" before it is JSON whitespace): str.splitlines also breaks at U+2028 / U+0085, which an
    # answer's JSON string may hold unescaped, as server.tuning.pairs.jsonl_rows reads its files
    for n, line in enumerate(body.decode("utf-8", errors="strict").split("\n"), 1):
        if line.strip():
            try:
                record = json.loads(line)
            except RecursionError:
                raise ValueError(f"line {n}: JSON nested deeper than {MAX_DEPTH} levels") from None
            except ValueError as exc:
                raise ValueError(f"line {n}: {exc}") from None
            check_values(record, f"line {n}")
            records.append(record)
    return records


def admin_router(auth: Auth, completer: Completer, max_body_bytes: int) -> APIRouter:
    router = APIRouter(prefix="/admin/cache", dependencies=[Depends(auth.check_admin)])

    def cache():
        if completer.cache is None:
            raise APIError(400, "the request cache is off on this server (--no-request-cache)")
        return completer.cache

    @router.post("/invalidate", openapi_extra=openapi_body(InvalidateRequest))
    async def invalidate(request: Request):
        """Embeds (similar_to) and deletes from the store: in a worker thread, never on the event loop. The body is
        read after the token is checked, and within --max-body-bytes."""
        body = await parse_body(request, InvalidateRequest, max_body_bytes)
        try:
            deleted = await asyncio.to_thread(
                cache().invalidate, entry_id=body.id, tag=body.tag, partition=body.partition, model=body.model,
                tenant=body.tenant, similar_to=body.similar_to, min_similarity=body.min_similarity)
        except ValueError as exc:
            raise APIError(400, str(exc), code="invalid_value") from None
        return {"deleted": deleted}

    @router.get("/stats")
    async def stats():
        return {"model": completer.model_key, "request_cache": cache().stats(), "engine": completer.engine.stats()}

    @router.get("/review")
    async def review(limit: int = Query(50, ge=0, le=1000)):
        return {"data": cache().review(limit)}

    @router.post("/warmup")
    async def warmup(request: Request, tenant: str = DEFAULT_TENANT,
                     temperature: float = Query(0.0, ge=0.0, allow_inf_nan=False),
                     max_tokens: int | None = Query(None, ge=1)):
        """Body: JSONL lines {"question", "answer", "tags"?, "ttl_class"?}, keyed like a chat request with these
        sampling settings (a request with other max_tokens or temperature lives in another partition; without
        max_tokens, the server's --default-max-tokens, as a request without one is keyed)."""
        body = await read_body(request, max_body_bytes * 16)
        target = cache()
        sampling = cache_sampling(temperature, max_tokens=max_tokens or completer.config.default_max_tokens)

        def parse_and_write() -> tuple[int, int]:      # parsing megabytes and embedding: in a worker thread
            records = _jsonl_records(body)
            return target.warmup(records, tenant=tenant, model=completer.model_key, sampling=sampling), len(records)

        try:
            written, records = await asyncio.to_thread(parse_and_write)
        except ValueError as exc:
            raise APIError(400, f"warm-up body: {exc}", code="invalid_value") from None
        except WarmupIncomplete as exc:     # a full disk answered 200 {"written": 1} for 300 records (audit)
            raise APIError(503, str(exc), code="store_unavailable") from None
        return {"written": written, "records": records}

    return router
