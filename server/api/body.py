"""Request bodies read with a size cap and parsed into a pydantic model, failing with OpenAI-shaped errors."""
from __future__ import annotations

import json
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from strata.server.api.errors import APIError, invalid

M = TypeVar("M", bound=BaseModel)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"request body is larger than {limit} bytes", code="request_too_large")


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refusing early (by Content-Length) or while streaming once it passes `limit`."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _too_large(limit)
    return bytes(body)


async def parse_body(request: Request, model: type[M], limit: int) -> M:
    raw = await read_body(request, limit)
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise APIError(400, f"malformed JSON body: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise invalid(exc) from None
