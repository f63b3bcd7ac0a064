"""Engine kill drill: the engine process is killed (as by the OOM killer) while requests are in flight. They get a
clear 503, new ones get 503 + Retry-After while a new engine process starts, streams arriving meanwhile get their 503
before any body, /health walks starting -> ok, and after the restart budget the server gives up (exit status 1)."""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest
from helpers.cli_server import start_cli_server, wait_healthy
from helpers.http_server import ADMIN, hash_semantic, start_server
from prometheus_client.parser import text_string_to_metric_families

from strata.server.api.config import ServerConfig
from strata.server.engine.engine_client import RestartPolicy

pytestmark = [pytest.mark.http, pytest.mark.slow]
# the tiny chat model (the drill is about the process, not the answers); ignore_eos keeps the long one running
LONG = {"messages": [{"role": "user", "content": "Write a very long story about a lighthouse."}],
        "max_tokens": 400, "temperature": 0, "ignore_eos": True}


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout} s: {what}")


def test_kill_in_flight_then_recover_within_30_s(tiny_chat_engine):
    slow_restart = RestartPolicy(max_restarts=3, window_s=300, backoff_s=2.0, max_backoff_s=2.0)
    with start_server(hash_semantic(), restart=slow_restart, engine=tiny_chat_engine) as server:
        long = dict(LONG, model=server.model)
        engine = server.app.state.completer.engine
        first_pid = engine.process.pid
        in_flight = {}

        def long_request():
            with server.http() as http:
                in_flight["res"] = http.post("/v1/chat/completions", json=long)

        worker = threading.Thread(target=long_request)
        worker.start()
        wait_for(lambda: engine.num_pending == 1 and server.stats().get("num_running"), 60, "request running")
        killed_at = time.monotonic()
        os.kill(first_pid, signal.SIGKILL)
        worker.join(timeout=30)
        res = in_flight["res"]
        assert res.status_code == 503 and res.json()["error"]["code"] == "engine_unavailable"
        assert "died" in res.json()["error"]["message"]

        wait_for(lambda: engine.state == "starting", 10, "state starting")
        with server.http() as http:
            refused = http.post("/v1/chat/completions", json=dict(long, max_tokens=4))
            assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
            # the backoff left and a start's length: not 1 s while a restart takes seconds more
            assert engine.load_s > 0 and int(refused.headers["retry-after"]) >= round(engine.load_s)
            with http.stream("POST", "/v1/chat/completions", json=dict(long, stream=True)) as stream:
                assert stream.status_code == 503        # up front: not 200 and an in-band error later
        with server.http(None) as http:
            health = http.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "starting"
            assert "exit code -9" in health.json()["reason"] and "Traceback" not in health.text
        assert engine_metrics(server) == (0.0, 0.0)          # /metrics says the engine is down too

        wait_for(lambda: engine.state == "ok", 30 - (time.monotonic() - killed_at), "engine back within 30 s")
        assert engine.process.pid != first_pid and engine.restarts == 1
        with server.http() as http:
            again = http.post("/v1/chat/completions", json=dict(long, max_tokens=4))
        assert again.status_code == 200 and again.json()["choices"][0]["finish_reason"] == "length"
        with server.http(None) as http:
            body = http.get("/health").json()
        assert body["status"] == "ok" and body["engine_restarts"] == 1
        assert engine_metrics(server) == (1.0, 1.0)
        assert server.idle_blocks(0) == 0


def engine_metrics(server) -> tuple[float, float]:
    """(strata_engine_up, strata_engine_restarts_total) as /metrics says."""
    with server.http(ADMIN) as http:
        samples = {s.name: s.value for f in text_string_to_metric_families(http.get("/metrics").text)
                   for s in f.samples}
    return samples["strata_engine_up"], samples["strata_engine_restarts_total"]


def test_past_the_restart_budget_the_client_fails_for_good(tiny_chat_engine):
    with start_server(hash_semantic(), restart=RestartPolicy(max_restarts=1, window_s=300, backoff_s=0.1,
                                                             max_backoff_s=0.1), engine=tiny_chat_engine) as server:
        engine = server.app.state.completer.engine
        os.kill(engine.process.pid, signal.SIGKILL)
        wait_for(lambda: engine.state == "ok" and engine.restarts == 1, 60, "first restart")
        os.kill(engine.process.pid, signal.SIGKILL)
        wait_for(lambda: engine.state == "failed", 10, "gave up")
        with server.http(None) as http:
            health = http.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "failed"
        assert "retry-after" not in health.headers
        with server.http() as http:
            res = http.post("/v1/chat/completions", json=dict(LONG, model=server.model, max_tokens=4))
        assert res.status_code == 503 and "retry-after" not in res.headers


def test_strata_serve_exits_non_zero_when_the_engine_keeps_dying(tiny_chat_model_dir):
    """With --engine-restarts 0 the first engine death stops the server with exit status 1 (for systemd/k8s)."""
    server, url = start_cli_server("--no-request-cache", "--model", str(tiny_chat_model_dir), "--dtype", "fp32",
                                   "--kv-cache-memory", "64MiB", "--num-threads", "1", "--engine-restarts", "0",
                                   stderr=subprocess.PIPE)
    try:
        wait_healthy(server, url, 300)
        engine_pid = int(open(f"/proc/{server.pid}/task/{server.pid}/children").read().split()[-1])
        os.kill(engine_pid, signal.SIGKILL)
        killed = time.monotonic()
        code = server.wait(timeout=30)
        assert code == 1 and time.monotonic() - killed < 30
        assert "the engine failed for good" in server.stderr.read().strip().splitlines()[-1]
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_an_engine_that_stops_stepping_with_requests_waiting_is_reported(tiny_chat_engine):
    """A stopped engine (SIGSTOP here; a wedged one alike) held requests with /health saying ok."""
    with start_server(hash_semantic(), config=ServerConfig(engine_stall_s=3.0), engine=tiny_chat_engine) as server:
        engine = server.app.state.completer.engine
        os.kill(engine.process.pid, signal.SIGSTOP)
        done = {}
        try:
            def waiting_request():
                with server.http() as http:
                    done["res"] = http.post("/v1/chat/completions", json=dict(LONG, model=server.model,
                                                                              max_tokens=4))

            worker = threading.Thread(target=waiting_request)
            worker.start()
            wait_for(lambda: engine.num_pending == 1, 10, "request sent")
            with server.http(None) as http:
                assert http.get("/health").json()["status"] == "ok"        # a moment is no stall yet
                time.sleep(3.5)
                health = http.get("/health").json()
            assert health["status"] == "degraded" and "reported no step for" in health["reason"]
            assert "1 request(s) wait" in health["reason"]
        finally:
            os.kill(engine.process.pid, signal.SIGCONT)
        worker.join(timeout=60)
        assert done["res"].status_code == 200
        with server.http(None) as http:
            assert http.get("/health").json()["status"] == "ok"


def test_an_engine_stopped_past_the_stall_limit_is_killed_and_restarted(tiny_chat_engine):
    """A wedged engine (SIGSTOP here) held its requests until their clients gave up, and every later one behind it:
    past --engine-stall-restart-s it is killed, the waiting request gets a clear 503, and a new process serves."""
    policy = RestartPolicy(max_restarts=3, window_s=300, backoff_s=0.5, max_backoff_s=0.5, stall_s=3.0)
    with start_server(hash_semantic(), restart=policy, engine=tiny_chat_engine) as server:
        engine = server.app.state.completer.engine
        first_pid = engine.process.pid
        os.kill(first_pid, signal.SIGSTOP)
        done = {}

        def waiting_request():
            with server.http() as http:
                done["res"] = http.post("/v1/chat/completions", json=dict(LONG, model=server.model, max_tokens=4))

        worker = threading.Thread(target=waiting_request)
        worker.start()
        wait_for(lambda: engine.num_pending == 1, 10, "request sent")
        sent = time.monotonic()
        worker.join(timeout=30)
        res = done["res"]
        assert res.status_code == 503 and "killed as wedged" in res.json()["error"]["message"]
        assert time.monotonic() - sent >= 2.5           # not before the limit (3 s after the engine's last word)
        wait_for(lambda: engine.state == "ok" and engine.process.pid != first_pid, 60, "a new engine process")
        with server.http() as http:
            again = http.post("/v1/chat/completions", json=dict(LONG, model=server.model, max_tokens=4))
        assert again.status_code == 200 and engine.restarts == 1


def test_the_stall_restart_flag_reaches_the_restart_policy():
    from strata.server.api.server import restart_policy

    assert restart_policy(ServerConfig()).stall_s == 600.0
    assert restart_policy(ServerConfig(engine_stall_restart_s=0)).stall_s == 0.0       # 0: never
    with pytest.raises(ValueError, match="engine_stall_restart_s"):
        ServerConfig(engine_stall_restart_s=-1)
    with pytest.raises(ValueError, match="stall limit"):
        RestartPolicy(stall_s=float("nan"))
