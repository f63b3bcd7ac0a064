"""The OpenAI-compatible routes: chat and text completions (JSON or SSE) and the model list."""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import aclosing

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from strata.server.api import batch
from strata.server.api.auth import Auth
from strata.server.api.body import parse_body
from strata.server.api.errors import APIError
from strata.server.api.logprobs import LogprobsFormat
from strata.server.api.metrics import Metrics
from strata.server.api.protocol import MAX_CHOICES, ChatCompletionRequest, CompletionRequest, Shape, openapi_body
from strata.server.api.serving import Answer, Completer

log = logging.getLogger("strata.server")


def openai_router(auth: Auth, completer: Completer, metrics: Metrics, max_body_bytes: int) -> APIRouter:
    router = APIRouter(prefix="/v1")
    info = completer.info

    async def complete(request: Request, kind: type[ChatCompletionRequest] | type[CompletionRequest]):
        started = time.perf_counter()
        chat = kind is ChatCompletionRequest
        endpoint = "chat" if chat else "completions"
        try:
            tenant = auth.tenant(request)
            req = await parse_body(request, kind, max_body_bytes)
            client = f"{tenant}:{request.client.host if request.client else '-'}"
            answers = await _answers(completer, req, tenant, request.headers.get("cache-control", ""), client,
                                     started)
        except APIError as exc:
            metrics.observe_error(endpoint, exc.status)
            raise
        include_usage, continuous = req.stream_options.usage_in() if req.stream and req.stream_options else (False, False)
        shape = Shape(chat, req.model, usage_null=include_usage)
        formats = [None if a.logprobs is None else LogprobsFormat(completer.inputs.tokenizer, chat) for a in answers]
        if req.stream and all(a.cached_text is not None for a in answers):
            # the same SSE events, written at once: a streaming response's task group costs a hit more than its lookup
            events = _open(shape, answers) + "".join(_data(_content(shape, answers, a.cached_text, i, None, continuous))
                                                     for i, a in enumerate(answers))
            for answer in answers:
                metrics.observe(endpoint, answer)
            return Response(events + _close(shape, answers, formats, include_usage), media_type="text/event-stream",
                            headers=batch.headers(answers))
        if req.stream:      # the background task runs even when the client left before the body was iterated
            return StreamingResponse(_events(shape, answers, formats, include_usage, continuous, metrics, endpoint),
                                     media_type="text/event-stream", headers=batch.headers(answers),
                                     background=BackgroundTask(batch.release, answers))
        status = 500
        try:
            texts = await _unless_disconnected(request, batch.texts(answers))
            status = 499 if texts is None else 200
        except APIError as exc:
            status = exc.status
            raise
        finally:
            batch.release(answers)
            for answer in answers:      # a client that left is counted too (499), as a stream's is
                metrics.observe(endpoint, answer, status)
        if texts is None:
            return Response(status_code=499)  # nobody is listening; the sequences were aborted
        choices = [(text, a.finish_reason, fmt(a.take_logprobs()) if fmt else None)
                   for text, a, fmt in zip(texts, answers, formats, strict=True)]
        return JSONResponse(shape.response(choices, batch.total_usage(answers), batch.strata(answers)),
                            headers=batch.headers(answers))

    @router.post("/chat/completions", openapi_extra=openapi_body(ChatCompletionRequest))
    async def chat_completions(request: Request):
        return await complete(request, ChatCompletionRequest)

    @router.post("/completions", openapi_extra=openapi_body(CompletionRequest))
    async def completions(request: Request):
        return await complete(request, CompletionRequest)

    def model_card() -> dict:
        return {"id": info.model_id, "object": "model", "created": int(time.time()), "owned_by": "strata",
                "root": completer.model_key, "max_model_len": info.max_model_len}

    @router.get("/models")
    async def models(request: Request):
        auth.tenant(request)
        return {"object": "list", "data": [model_card()]}

    @router.get("/models/{model:path}")
    async def model(request: Request, model: str):
        """One model (the openai client's models.retrieve)."""
        auth.tenant(request)
        completer.check_model(model)
        return model_card()

    return router


def _data(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _answers(completer: Completer, req: ChatCompletionRequest | CompletionRequest, tenant: str,
                   cache_control: str, client: str, started: float) -> list[Answer]:
    """n answers per prompt (chat: one prompt), choice index prompt * n + sample; when one is refused, those taken
    already are released."""
    prompts = [None] if isinstance(req, ChatCompletionRequest) else req.prompt
    if len(prompts) * req.n > MAX_CHOICES:
        raise APIError(400, f"at most {MAX_CHOICES} choices per request (prompts x n), got {len(prompts) * req.n}",
                       param="n", code="invalid_value")
    answers: list[Answer] = []
    origin = uuid.uuid4().hex if len(prompts) > 1 else None     # its prompts must not wait on each other's flights
    try:
        for prompt in prompts:
            leader = None
            for sample in range(req.n):
                answer = await completer.answer(req, tenant, cache_control, client, started, prompt, leader, sample,
                                                origin)
                answers.append(answer)
                leader = leader or answer
    except BaseException:
        batch.release(answers)
        raise
    return answers


def _open(shape: Shape, answers: list[Answer]) -> str:
    """The first SSE event of each choice: the assistant role and where the answer comes from."""
    return "".join(_data(shape.chunk("", first=True, index=i) | {"strata": a.strata()})
                   for i, a in enumerate(answers))


def _content(shape: Shape, answers: list[Answer], piece: str, index: int, logprobs: dict | None,
             continuous: bool) -> dict:
    """One content chunk of choice `index`, with the usage so far (all choices) when the client asked for it in
    every chunk (vLLM's stream_options.continuous_usage_stats)."""
    chunk = shape.chunk(piece, logprobs=logprobs, index=index)
    return chunk | {"usage": batch.total_usage(answers)} if continuous else chunk


def _close(shape: Shape, answers: list[Answer], formats: list[LogprobsFormat | None], include_usage: bool) -> str:
    """Each choice's finish reason (with the logprobs of tokens that brought no text, such as a stop token), usage
    when asked for, then [DONE]."""
    ends = "".join(_data(shape.chunk("", a.finish_reason, logprobs=fmt(a.take_logprobs()) if fmt else None, index=i))
                   for i, (a, fmt) in enumerate(zip(answers, formats, strict=True)))
    usage = _data(shape.usage_chunk(batch.total_usage(answers))) if include_usage else ""
    return ends + usage + _data("[DONE]")


async def _events(shape: Shape, answers: list[Answer], formats: list[LogprobsFormat | None], include_usage: bool,
                  continuous: bool, metrics: Metrics, endpoint: str):
    """SSE in OpenAI's chunk format, each chunk with the logprobs of the tokens whose text it carries; a client
    that goes away closes the pieces, which aborts the sequences."""
    status = 499
    try:
        yield _open(shape, answers)
        async with aclosing(batch.merged(answers)) as pieces:
            async for index, piece, entries in pieces:
                fmt = formats[index]
                yield _data(_content(shape, answers, piece, index, fmt(entries) if fmt else None, continuous))
        yield _close(shape, answers, formats, include_usage)
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
        for answer in answers:
            metrics.observe(endpoint, answer, status)


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
