"""Running the app: `strata serve` (engine process, caches, uvicorn) and a server in a thread for tests and benches."""
from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI

from strata.cache.request.config import RequestCacheConfig
from strata.cache.request.request_cache import RequestCache
from strata.server.api.app import create_app
from strata.server.api.auth import Auth
from strata.server.api.config import ServerConfig
from strata.server.engine.config import EngineConfig
from strata.server.engine.engine_client import EngineClient, RestartPolicy
from strata.server.engine.engine_process import configure_logging

log = logging.getLogger("strata.server")


def build_cache(config: RequestCacheConfig) -> RequestCache:
    """The request cache a config describes; a semantic layer that cannot load degrades to exact-only, loudly, unless
    the operator named a calibration file: then ValueError, as serving without the file they chose is not what they
    asked for."""
    store = RequestCache.open_store(config)     # first: a file held by another server is refused in a moment, not
    semantic = None                             # after the embedders load
    if config.semantic:
        from strata.cache.request.semantic import SemanticCache

        try:
            semantic = SemanticCache.from_config(config)
        except (OSError, KeyError, ValueError) as exc:
            if config.semantic_calibration:
                store.close()
                raise ValueError(f"--semantic-calibration {config.semantic_calibration}: {exc}") from None
            log.warning("semantic cache off (%s: %s); serving with the exact layer only", type(exc).__name__, exc)
    return RequestCache(config, semantic=semantic, store=store)


class EngineFailed(RuntimeError):
    """The engine process died more often than the restart policy allows: the server stopped (exit status 1)."""


def check_listen(host: str, port: int) -> None:
    """ValueError naming the flags when the address cannot be listened on: found at the start, not after the model,
    kernels and caches have loaded (a taken port failed only then, with uvicorn's message naming neither flag)."""
    try:
        family, kind, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise ValueError(f"--host {host}: {exc.strerror}") from None
    with socket.socket(family, kind) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)      # as uvicorn binds it
        try:
            probe.bind(address)
        except OSError as exc:
            raise ValueError(f"--host {host} --port {port}: cannot listen there ({exc.strerror})") from None


def run_server(engine_config: EngineConfig, config: ServerConfig) -> None:
    """Load the model (in the engine process) and the caches (here, meanwhile), then serve until interrupted
    (`strata serve`). EngineStartError when the engine cannot be built, OSError/ValueError for a bad keys file,
    EngineFailed when the engine kept dying."""
    configure_logging()
    auth = Auth(Auth.read_keys(config.api_keys) if config.api_keys else None, config.admin_token,
                config.public_metrics)
    failure: list[str] = []
    server: uvicorn.Server | None = None

    def give_up(why: str) -> None:          # from the supervisor thread: stop serving, then exit non-zero
        failure.append(why)
        if server is not None:
            server.should_exit = True

    exit_on_sigterm()
    check_listen(config.host, config.port)
    engine = EngineClient(engine_config, restart_policy(config), on_failed=give_up)
    try:                    # start() inside: a SIGTERM between the spawn and its return must still stop the process
        engine.start()
        cache = build_cache(config.cache) if config.request_cache else None
        if "cache" in engine_config.speculative.split("+") and (cache is None or cache.semantic is None):
            log.warning("--speculative cache drafts from the semantic cache's close answers: with it off, nothing")
        engine.wait_ready()
        exit_if_signalled()
        server = GracefulServer(uvicorn.Config(create_app(engine, cache, auth=auth, config=config), host=config.host,
                                               port=config.port, log_level="info", access_log=config.access_log,
                                               timeout_graceful_shutdown=config.shutdown_timeout_s),
                                engine.refuse_in_flight)
        if not failure:
            server.run()
    finally:
        engine.stop()
    if failure:
        raise EngineFailed(f"the engine failed for good: {failure[0]}")


class GracefulServer(uvicorn.Server):
    """uvicorn, except that requests still running when the shutdown's grace is about to end get a clean error (503
    `engine_unavailable`, in-band for a stream) instead of a cut connection or a plain-text 500."""

    CUT_MARGIN_S = 1.0          # before uvicorn cancels what is left: time for the errors to reach the clients

    def __init__(self, config: uvicorn.Config, refuse_in_flight: Callable[[str], None]):
        super().__init__(config)
        self.refuse_in_flight = refuse_in_flight

    async def shutdown(self, sockets=None) -> None:
        grace = self.config.timeout_graceful_shutdown
        cut = None if grace is None else asyncio.get_running_loop().call_later(
            max(0.0, grace - self.CUT_MARGIN_S), self.refuse_in_flight,
            f"the server is shutting down (--shutdown-timeout-s {grace:g} ran out)")
        try:
            await super().shutdown(sockets)
        finally:
            if cut is not None:
                cut.cancel()


_SIGNALLED: list[int] = []      # SIGTERMs received before uvicorn took the signal over


def exit_on_sigterm() -> None:
    """SIGTERM raises SystemExit until uvicorn installs its own handlers, so a stop during startup still runs the
    `finally` that stops the engine process (the default action would leave it loading, orphaned)."""
    def stop(signum, frame) -> None:
        _SIGNALLED.append(signum)
        sys.exit(128 + signum)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, stop)


def exit_if_signalled() -> None:
    """A SIGTERM whose SystemExit was swallowed (raised inside a __del__, "Exception ignored", or an import that
    wrapped it) still stops the start: the server went on to serve once in 17 tries."""
    if _SIGNALLED:
        sys.exit(128 + _SIGNALLED[0])


def restart_policy(config: ServerConfig) -> RestartPolicy:
    return RestartPolicy(max_restarts=config.engine_restarts, window_s=config.engine_restart_window_s,
                         start_timeout_s=config.engine_start_timeout_s, stall_s=config.engine_stall_restart_s)


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
