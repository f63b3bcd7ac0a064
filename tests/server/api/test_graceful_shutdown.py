"""A shutdown whose grace runs out answers the requests still running with a clean error instead of cutting them."""
import asyncio
import threading
import time

import httpx
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from strata.server.api.server import GracefulServer


def test_requests_still_running_when_the_grace_ends_get_an_error_not_a_cut_connection():
    """Audit 14: with a short --shutdown-timeout-s, uvicorn cancelled what was left: a plain-text 500 for a whole
    answer, a truncated body for a stream. Here a request waits on a fake engine that never answers."""
    app, waiting = FastAPI(), []

    @app.get("/answer")
    async def answer():
        done = asyncio.get_running_loop().create_future()
        waiting.append((asyncio.get_running_loop(), done))
        try:
            return JSONResponse({"text": await done})
        except RuntimeError as exc:         # what EngineUnavailable becomes on the real routes: a 503
            return JSONResponse({"error": {"message": str(exc), "code": "engine_unavailable"}}, status_code=503)

    def refuse(why: str) -> None:
        for loop, done in waiting:
            loop.call_soon_threadsafe(done.set_exception, RuntimeError(why))

    server = GracefulServer(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                           timeout_graceful_shutdown=1.5), refuse)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    reply: list = []
    client = threading.Thread(target=lambda: reply.append(httpx.get(f"http://127.0.0.1:{port}/answer", timeout=30)))
    client.start()
    while not waiting:
        time.sleep(0.02)
    began = time.monotonic()
    server.should_exit = True                       # what SIGTERM does
    client.join(30)
    thread.join(30)
    assert reply and reply[0].status_code == 503, reply
    assert "shutting down (--shutdown-timeout-s 1.5 ran out)" in reply[0].json()["error"]["message"]
    assert 0.3 < time.monotonic() - began < 1.5     # before uvicorn's own cut at 1.5 s
