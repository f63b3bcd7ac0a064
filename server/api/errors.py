"""OpenAI-shaped errors: one exception type and the handlers that turn every failure into {"error": {...}}."""
from __future__ import annotations

import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from strata.server.api import unsupported

log = logging.getLogger("strata.server")
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error", 503: "server_error"}


class APIError(Exception):
    """A failure the client should see with this status, message, param and code."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def response(self) -> JSONResponse:
        kind = _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        body = {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def invalid(err: ValidationError | RequestValidationError) -> APIError:
    """The first validation problem as a 400 naming the offending field (OpenAI reports one at a time)."""
    first = err.errors()[0]
    loc = [str(p) for p in first["loc"] if p != "body"]
    param = ".".join(loc) or None
    if first["type"] == "extra_forbidden":
        message, code = unsupported.refusal(param)
        return APIError(400, message, param=param, code=code)
    code = {"missing": "missing_required_parameter", unsupported.ERROR_TYPE: unsupported.ERROR_TYPE}
    return APIError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param,
                    code=code.get(first["type"], "invalid_value"))


def install(app: FastAPI) -> None:
    """Route every error path (ours, FastAPI's, Starlette's, unexpected) to the OpenAI error shape."""

    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        return invalid(exc).response()

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException):
        return APIError(exc.status_code, str(exc.detail), headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        """Details (and paths) go to the log under an id the client can quote; the client gets the id only."""
        incident = uuid.uuid4().hex[:12]
        log.error("unexpected error %s on %s %s", incident, request.method, request.url.path, exc_info=exc)
        return APIError(500, f"internal error (incident {incident}; details are in the server log)",
                        code="internal_error").response()
