"""OpenAI-compatible HTTP server: the exact + semantic request caches in front of the engine (KV cache), which steps
in a process of its own (server/async_engine.py) so that model steps never hold this process's GIL.

create_app() wires routes to a Completer (the shared request path); run_server() builds everything from CLI flags.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import aclosing, asynccontextmanager, contextmanager
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from strata.cache.request.request_cache import RequestCache, RequestCacheConfig
from strata.server import http_errors
from strata.server.admin import admin_router
from strata.server.async_engine import AsyncLLMEngine
from strata.server.auth import Auth
from strata.server.body import parse_body
from strata.server.config import EngineConfig
from strata.server.http_errors import APIError
from strata.server.metrics import Metrics
from strata.server.openai_protocol import ChatCompletionRequest, CompletionRequest, Shape
from strata.server.serving import Answer, Completer, Settings

STATIC = Path(__file__).with_name("static")
log = logging.getLogger("strata.server")


def create_app(aengine: AsyncLLMEngine, cache: RequestCache | None = None, *, auth: Auth | None = None,
               settings: Settings | None = None) -> FastAPI:
    """An app serving a ready engine process (its `wait_ready` returned) behind `cache`; the app's shutdown stops
    the engine process and closes the cache, so one engine process serves one app."""
    auth = auth or Auth()
    settings = settings or Settings()
    completer = Completer(aengine, cache, settings)
    metrics = Metrics(aengine.stats, cache, completer.model_key)
    info = completer.info

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        try:
            yield
        finally:
            aengine.stop()
            if cache is not None:
                cache.close()

    app = FastAPI(title="Strata", lifespan=lifespan)
    app.state.completer, app.state.metrics, app.state.settings = completer, metrics, settings
    http_errors.install(app)
    app.include_router(admin_router(auth, completer, settings.max_body_bytes))

    async def complete(request: Request, kind: type[ChatCompletionRequest] | type[CompletionRequest]):
        started = time.perf_counter()
        endpoint = "chat" if kind is ChatCompletionRequest else "completions"
        try:
            tenant = auth.tenant(request)
            req = await parse_body(request, kind, settings.max_body_bytes)
            client = f"{tenant}:{request.client.host if request.client else '-'}"
            answer = await completer.answer(req, tenant, request.headers.get("cache-control", ""), client,
                                             started)
        except APIError as exc:
            metrics.observe_error(endpoint, exc.status)
            raise
        shape = Shape(kind is ChatCompletionRequest, req.model)
        include_usage = req.stream and req.stream_options is not None and req.stream_options.include_usage
        if req.stream and answer.cached_text is not None:
            # the same SSE events, written at once: a streaming response's task group costs a hit more than its lookup
            events = _open(shape, answer) + _data(shape.chunk(answer.cached_text)) + \
                _close(shape, answer, include_usage)
            metrics.observe(endpoint, answer)
            return Response(events, media_type="text/event-stream", headers=answer.headers())
        if req.stream:
            return StreamingResponse(_events(shape, answer, include_usage, metrics, endpoint),
                                     media_type="text/event-stream", headers=answer.headers())
        if answer.cached_text is not None:
            text = answer.cached_text
        else:
            async with aclosing(answer.pieces) as pieces:
                text = await _unless_disconnected(request, _join(pieces))
            if text is None:
                return Response(status_code=499)  # nobody is listening; the sequence was aborted
        metrics.observe(endpoint, answer)
        return JSONResponse(shape.response(text, answer.finish_reason, answer.usage(), answer.strata()),
                            headers=answer.headers())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, ChatCompletionRequest)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, CompletionRequest)

    @app.get("/v1/models")
    async def models(request: Request):
        auth.tenant(request)
        return {"object": "list", "data": [{"id": info.model_id, "object": "model", "created": int(time.time()),
                                            "owned_by": "strata", "root": completer.model_key,
                                            "max_model_len": info.max_model_len}]}

    @app.get("/health")
    async def health():
        if not aengine.alive:
            raise APIError(503, f"engine process stopped: {aengine.error!r}", code="engine_dead")
        return {"status": "ok", "pending": aengine.num_pending}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/status")
    async def status():
        return metrics.status() | {"pending": aengine.num_pending, "request_cache": cache is not None}

    @app.get("/")
    async def status_page():
        return FileResponse(STATIC / "index.html")

    @app.get("/static/{name}")
    async def static(name: str):
        path = STATIC / name
        if path.parent != STATIC or not path.is_file():
            raise APIError(404, f"no static file {name!r}")
        return FileResponse(path)

    return app


def _data(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _open(shape: Shape, answer: Answer) -> str:
    """The first SSE event: the assistant role and where the answer comes from."""
    return _data(shape.chunk("", first=True) | {"strata": answer.strata()})


def _close(shape: Shape, answer: Answer, include_usage: bool) -> str:
    """The finish reason, usage when asked for, then [DONE]."""
    usage = _data(shape.usage_chunk(answer.usage())) if include_usage else ""
    return _data(shape.chunk("", answer.finish_reason)) + usage + _data("[DONE]")


async def _events(shape: Shape, answer: Answer, include_usage: bool, metrics: Metrics, endpoint: str):
    """SSE in OpenAI's chunk format; a client that goes away closes the pieces, which aborts the sequence."""
    status = 499
    try:
        yield _open(shape, answer)
        async with aclosing(answer.pieces) as pieces:
            async for piece in pieces:
                yield _data(shape.chunk(piece))
        yield _close(shape, answer, include_usage)
        status = 200
    except Exception as exc:     # headers are gone: report in-band, as OpenAI does
        status = 500
        log.exception("stream failed")
        yield _data({"error": {"message": f"{type(exc).__name__}: {exc}", "type": "server_error", "param": None,
                               "code": None}})
    finally:
        metrics.observe(endpoint, answer, status)


def build_cache(db_path: str | None, embedder: str, verifier: bool = True) -> RequestCache:
    """The request cache from flags; a semantic layer that cannot load degrades to exact-only, loudly."""
    config = RequestCacheConfig(db_path=db_path, embedder=embedder if embedder != "none" else "auto",
                                second_stage=verifier)
    semantic = None
    if embedder != "none":
        from strata.cache.request.semantic import SemanticCache

        try:
            semantic = SemanticCache.from_config(config)
        except (OSError, KeyError, ValueError) as exc:
            log.warning("semantic cache off (%s: %s); serving with the exact layer only", type(exc).__name__, exc)
    if db_path:
        Path(db_path).parent.mkdir(parents=True, exist_ok=True)
    return RequestCache(config, semantic=semantic)


def run_server(engine_config: EngineConfig, host: str = "127.0.0.1", port: int = 8000, *, auth: Auth | None = None,
               settings: Settings | None = None, request_cache: bool = True, cache_db: str | None = None,
               embedder: str = "auto", verifier: bool = True, access_log: bool = True) -> None:
    """Load the model (in the engine process) and the caches (here, meanwhile), then serve until interrupted
    (`strata serve`); EngineStartError when the engine cannot be built."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    aengine = AsyncLLMEngine(engine_config)
    aengine.start()
    try:
        cache = build_cache(cache_db, embedder, verifier) if request_cache else None
        aengine.wait_ready()
        uvicorn.run(create_app(aengine, cache, auth=auth, settings=settings), host=host, port=port,
                    log_level="info", access_log=access_log)
    finally:
        aengine.stop()


@contextmanager
def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Run `app` under uvicorn in a daemon thread (tests, benchmarks); yields its base URL, port 0 = a free one."""
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="strata-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    bound = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{bound}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)


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
