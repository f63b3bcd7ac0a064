"""The OpenAI-compatible routes: chat and text completions (JSON or SSE) and the model list."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import aclosing

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from strata.server.api.auth import Auth
from strata.server.api.body import parse_body
from strata.server.api.errors import APIError
from strata.server.api.metrics import Metrics
from strata.server.api.protocol import ChatCompletionRequest, CompletionRequest, Shape, openapi_body
from strata.server.api.serving import Answer, Completer

log = logging.getLogger("strata.server")


def openai_router(auth: Auth, completer: Completer, metrics: Metrics, max_body_bytes: int) -> APIRouter:
    router = APIRouter(prefix="/v1")
    info = completer.info

    async def complete(request: Request, kind: type[ChatCompletionRequest] | type[CompletionRequest]):
        started = time.perf_counter()
        endpoint = "chat" if kind is ChatCompletionRequest else "completions"
        try:
            tenant = auth.tenant(request)
            req = await parse_body(request, kind, max_body_bytes)
            client = f"{tenant}:{request.client.host if request.client else '-'}"
            answer = await completer.answer(req, tenant, request.headers.get("cache-control", ""), client,
                                             started)
        except APIError as exc:
            metrics.observe_error(endpoint, exc.status)
            raise
        shape = Shape(kind is ChatCompletionRequest, req.model)
        include_usage, continuous = req.stream_options.usage_in() if req.stream and req.stream_options else (False, False)
        if req.stream and answer.cached_text is not None:
            # the same SSE events, written at once: a streaming response's task group costs a hit more than its lookup
            events = _open(shape, answer) + _data(_content(shape, answer, answer.cached_text, continuous)) + \
                _close(shape, answer, include_usage)
            metrics.observe(endpoint, answer)
            return Response(events, media_type="text/event-stream", headers=answer.headers())
        if req.stream:      # the background task runs even when the client left before the body was iterated
            return StreamingResponse(_events(shape, answer, include_usage, continuous, metrics, endpoint),
                                     media_type="text/event-stream", headers=answer.headers(),
                                     background=BackgroundTask(answer.release))
        if answer.cached_text is not None:
            text = answer.cached_text
        else:
            try:
                async with aclosing(answer.pieces) as pieces:
                    text = await _unless_disconnected(request, _join(pieces))
            finally:
                answer.release()
            if text is None:
                return Response(status_code=499)  # nobody is listening; the sequence was aborted
        metrics.observe(endpoint, answer)
        return JSONResponse(shape.response(text, answer.finish_reason, answer.usage(), answer.strata()),
                            headers=answer.headers())

    @router.post("/chat/completions", openapi_extra=openapi_body(ChatCompletionRequest))
    async def chat_completions(request: Request):
        return await complete(request, ChatCompletionRequest)

    @router.post("/completions", openapi_extra=openapi_body(CompletionRequest))
    async def completions(request: Request):
        return await complete(request, CompletionRequest)

    @router.get("/models")
    async def models(request: Request):
        auth.tenant(request)
        return {"object": "list", "data": [{"id": info.model_id, "object": "model", "created": int(time.time()),
                                            "owned_by": "strata", "root": completer.model_key,
                                            "max_model_len": info.max_model_len}]}

    return router


def _data(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _open(shape: Shape, answer: Answer) -> str:
    """The first SSE event: the assistant role and where the answer comes from."""
    return _data(shape.chunk("", first=True) | {"strata": answer.strata()})


def _content(shape: Shape, answer: Answer, piece: str, continuous: bool) -> dict:
    """One content chunk, with the usage so far when the client asked for it in every chunk."""
    return shape.chunk(piece) | ({"usage": answer.usage()} if continuous else {})


def _close(shape: Shape, answer: Answer, include_usage: bool) -> str:
    """The finish reason, usage when asked for, then [DONE]."""
    usage = _data(shape.usage_chunk(answer.usage())) if include_usage else ""
    return _data(shape.chunk("", answer.finish_reason)) + usage + _data("[DONE]")


async def _events(shape: Shape, answer: Answer, include_usage: bool, continuous: bool, metrics: Metrics,
                  endpoint: str):
    """SSE in OpenAI's chunk format; a client that goes away closes the pieces, which aborts the sequence."""
    status = 499
    try:
        yield _open(shape, answer)
        async with aclosing(answer.pieces) as pieces:
            async for piece in pieces:
                yield _data(_content(shape, answer, piece, continuous))
        yield _close(shape, answer, include_usage)
        status = 200
    except Exception as exc:     # headers are gone: report in-band, as OpenAI does
        status = exc.status if isinstance(exc, APIError) else 500
        if isinstance(exc, APIError):
            message, code = exc.message, exc.code
        else:
            log.exception("stream failed")
            message, code = "internal error; details are in the server log", "internal_error"
        yield _data({"error": {"message": message, "type": "server_error", "param": None, "code": code}})
    finally:
        metrics.observe(endpoint, answer, status)


async def _join(pieces) -> str:
    return "".join([piece async for piece in pieces])


async def _unless_disconnected(request: Request, work) -> str | None:
    """Await a non-streaming answer, cancelling it (which aborts its sequence and frees its blocks) when the
    client disconnects first; None then."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.2)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return None
