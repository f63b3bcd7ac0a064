"""Request bodies read with a size cap and parsed into a pydantic model, failing with OpenAI-shaped errors."""
from __future__ import annotations

import json
import re
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from strata.server.api.errors import APIError, invalid

M = TypeVar("M", bound=BaseModel)
MAX_DEPTH = 32                           # a chat body needs about 5 levels
_SURROGATE = re.compile("[\ud800-\udfff]")


def _too_large(limit: int) -> APIError:
    return APIError(413, f"request body is larger than {limit} bytes", code="request_too_large")


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refusing early (by Content-Length) or while streaming once it passes `limit`."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise _too_large(limit)
    except ClientDisconnect:    # a client that gave up (a timeout, a cancel): counted as one (499), not an incident
        raise APIError(499, "the client closed the connection before its request was read",
                       code="client_closed") from None
    return bytes(body)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def check_values(value, where: str = "body", depth: int = 0) -> None:
    """Refuse what JSON allows but no request needs: nesting past MAX_DEPTH and lone UTF-16 surrogates, which
    cannot be encoded as UTF-8 and would fail later, deep inside tokenizing or storing."""
    if depth > MAX_DEPTH:
        raise APIError(400, f"JSON nested deeper than {MAX_DEPTH} levels", code="invalid_json")
    if isinstance(value, str):
        if _SURROGATE.search(value):
            raise APIError(400, f"{where}: text holds a lone UTF-16 surrogate (invalid Unicode)", param=where,
                           code="invalid_value")
    elif isinstance(value, dict):
        for key, item in value.items():
            check_values(key, where, depth + 1)
            check_values(item, f"{where}.{key}" if where != "body" else key, depth + 1)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_values(item, f"{where}[{i}]", depth + 1)


async def parse_body(request: Request, model: type[M], limit: int) -> M:
    raw = await read_body(request, limit)
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise APIError(400, f"JSON nested deeper than {MAX_DEPTH} levels", code="invalid_json") from None
    except ValueError as exc:
        raise APIError(400, f"malformed JSON body: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    check_values(data)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise invalid(exc) from None
