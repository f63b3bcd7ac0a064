"""The engine steps in a process of its own, which builds the engine: its model limits and counters cross to the
HTTP process, it ends with the server (also when the server is killed), when it fails, requests in flight fail
loudly instead of hanging, and when it cannot start, `strata serve` says why."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from helpers.cli_server import start_cli_server, wait_healthy
from helpers.http_server import MODEL, ask, hash_semantic, start_server

from strata.server.engine.config import EngineConfig
from strata.server.engine.engine_client import EngineRequestFailed
from strata.server.engine.sampling_params import SamplingParams
from strata.server.engine.sequence import Sequence

pytestmark = [pytest.mark.http, pytest.mark.slow]


def gone(pid: int) -> bool:
    """No such process, or only its zombie (a killed server cannot reap its child; init may not either)."""
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return gone(pid)


def test_engine_steps_in_its_own_process_that_ends_with_the_server(tiny_chat_engine, tiny_chat_model_dir):
    with start_server(hash_semantic(), engine=tiny_chat_engine) as server:
        process = server.app.state.completer.engine.process
        assert process.pid != os.getpid() and process.is_alive()
        info, stats = server.inputs.info, server.stats()       # what the engine process reported at start
        assert info.model_id == tiny_chat_model_dir.name and info.vocab_size == 49152 and stats["kv_blocks_used"] == 0
        assert info.kv_capacity_tokens == stats["kv_capacity_tokens"]
        layer, _, out = ask(server, "Name a colour.")
        assert layer == "miss" and out.usage.completion_tokens > 0
        assert server.stats()["generated_tokens"] >= out.usage.completion_tokens   # counted there, read here
    assert process.exitcode == 0 and gone(process.pid)


def thread_nices(pid: int) -> dict[int, int]:
    """Nice value of each thread of a process (field 19 of /proc/PID/task/TID/stat)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(task.name)] = int((task / "stat").read_text().rsplit(")", 1)[1].split()[16])
        except FileNotFoundError:       # the thread ended meanwhile
            pass
    return out


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads per-thread nice values from Linux /proc")
@pytest.mark.parametrize("nice", [EngineConfig().engine_nice, 4])
def test_every_engine_thread_runs_below_the_http_process(tiny_chat_engine, nice):
    """Linux nice is per thread: the engine's compute threads (started while loading) must be reniced too, or they
    take the cores from the HTTP process's event loop at equal priority. --engine-nice sets how far below."""
    engine = dataclasses.replace(tiny_chat_engine, engine_nice=nice)
    with start_server(hash_semantic(), num_threads=2, engine=engine) as server:
        ask(server, "Name a colour.")                        # a step ran: the intra-op worker threads exist
        pid = server.app.state.completer.engine.process.pid
        nices = thread_nices(pid)
        assert len(nices) >= 2 and min(nices.values()) >= nice, nices
        if nice == 4:
            assert max(nices.values()) < EngineConfig().engine_nice, nices
        assert thread_nices(os.getpid())[threading.get_native_id()] == os.getpriority(os.PRIO_PROCESS, 0) < nice


def test_a_request_that_fails_in_the_engine_fails_alone(tiny_chat_engine):
    """A sequence that makes the model raise (a token id past the vocabulary, which validation would have refused)
    fails by itself; the request beside it completes and the engine process lives on."""
    with start_server(hash_semantic(), engine=tiny_chat_engine) as server:
        engine = server.app.state.completer.engine
        pid = engine.process.pid
        good = server.inputs.make_sequence("Write a long story.", SamplingParams(max_tokens=30, ignore_eos=True),
                                           chat=True)
        bad = Sequence("bad", [server.inputs.info.vocab_size + 5], SamplingParams(max_tokens=2))

        async def collect(seq: Sequence):
            return [out async for out in engine.submit(seq)]

        async def both():
            return await asyncio.gather(collect(good), collect(bad), return_exceptions=True)

        done, failed = asyncio.run(both())
        assert isinstance(failed, EngineRequestFailed) and "IndexError" in str(failed), failed
        assert done[-1].finish_reason == "length" and len(done[-1].token_ids) == 30
        assert engine.process.pid == pid and engine.state == "ok"
        with server.http(None) as http:
            assert http.get("/health").json()["status"] == "ok"
        assert ask(server, "Name a colour.")[0] == "miss"


def test_a_killed_engine_process_ends_a_stream_in_flight_with_an_error():
    with start_server(hash_semantic()) as server:
        process = server.app.state.completer.engine.process
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story about a ship."}],
                "max_tokens": 300, "temperature": 0, "stream": True}
        with server.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as res:
            lines = res.iter_lines()
            while '"content"' not in next(lines):
                pass
            os.kill(process.pid, signal.SIGKILL)
            rest = list(lines)                       # the stream ends instead of hanging
        assert any('"error"' in line and "engine process died" in line and "engine_unavailable" in line
                   for line in rest), rest[-3:]


def test_an_engine_stopped_twice_or_before_it_starts_stays_down_and_raises_nothing(tiny_chat_engine):
    """The supervisor (restarting a dead engine) and the server's shutdown can stop one process at once; the second
    may still see the process alive after the first closed its queue (this made a stop put into a closed queue)."""
    from strata.server.engine.engine_client import EngineProcess

    engine = EngineProcess(tiny_chat_engine, 1, lambda update: None)
    engine.start()
    assert engine.ready.wait(60) and engine.info is not None
    engine.stop()
    assert engine.process.exitcode == 0
    engine.process.is_alive = lambda: True        # the stale view of a concurrent stop()
    engine.dead.clear()
    engine.stop()
    engine.send("abort", "some-request")

    early = EngineProcess(tiny_chat_engine, 1, lambda update: None)
    early.stop()                                  # the shutdown came between the restart's new process and its start
    early.start()
    assert early.ready.is_set() and early.dead.is_set() and early.process.pid is None


def test_the_engine_process_starts_with_ctrl_c_ignored_and_a_start_past_its_timeout_fails(tiny_chat_engine):
    """Ctrl-C during the child's imports printed a KeyboardInterrupt traceback from it (the server stops it); a start
    had 600 s fixed, now --engine-start-timeout-s."""
    from strata.server.engine.engine_client import EngineClient, EngineStartError, RestartPolicy

    engine = EngineClient(tiny_chat_engine, RestartPolicy(start_timeout_s=0.05))
    engine.start()
    try:
        pid = engine.current.process.pid
        ignored = next(int(line.split()[1], 16) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                       if line.startswith("SigIgn:"))
        assert ignored & (1 << (signal.SIGINT - 1)), hex(ignored)        # before its own code could set it
        with pytest.raises(EngineStartError, match="no engine within 0 s"):
            engine.wait_ready()
    finally:
        engine.stop()
    with pytest.raises(ValueError, match="start timeout"):
        RestartPolicy(start_timeout_s=0)


def test_a_restart_that_does_not_come_up_in_time_is_killed_and_counted_as_a_death(tiny_chat_engine):
    """Audit 13: a restart past --engine-start-timeout-s was left loading and the server said "starting" for good (no
    death counted, never given up, so systemd never restarted it; one that loaded late was never used)."""
    from strata.server.engine.engine_client import EngineClient, RestartPolicy

    failed: list[str] = []
    engine = EngineClient(tiny_chat_engine, RestartPolicy(max_restarts=1, backoff_s=0.05, max_backoff_s=0.05,
                                                          start_timeout_s=60), on_failed=failed.append)
    engine.start()
    try:
        engine.wait_ready()
        engine.restart = dataclasses.replace(engine.restart, start_timeout_s=0.05)    # restarts now take longer
        os.kill(engine.process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not failed and time.monotonic() < deadline:
            time.sleep(0.1)
        assert failed and "did not come up within 0.05 s" in failed[0] and engine.state == "failed"
        assert wait_gone(engine.current.process.pid, 10)
    finally:
        engine.stop()


def test_a_request_added_as_the_engine_dies_fails_instead_of_waiting_for_good(tiny_chat_engine):
    """Audit 13: a request registered after the supervisor had failed the streams of a dead engine (but before the
    state left "ok") had its add dropped and waited forever. Here the process is dead and the state still "ok"."""
    from strata.server.engine.engine_client import EngineClient, EngineUnavailable

    engine = EngineClient(tiny_chat_engine)
    engine.state = "ok"                         # the supervisor has not noticed yet
    engine.current.dead.set()

    async def first_output():
        async for out in engine.submit(Sequence("r1", [1, 2, 3], SamplingParams(max_tokens=2))):
            return out

    with pytest.raises(EngineUnavailable, match="died"):
        asyncio.run(asyncio.wait_for(first_output(), 5))
    assert engine.streams == {}


def test_a_restarted_engine_may_hold_another_context_length_but_not_another_model():
    """Audit 13: a KV pool sized from the memory free at the restart held another number of tokens, and the restart
    was refused as "another model" (deaths counted until the server gave up)."""
    import torch

    from strata.server.engine.input_processor import ModelInfo

    first = ModelInfo("m", None, torch.float32, 49152, 8192, 8192, "abc")
    assert first.serves_like(dataclasses.replace(first, max_model_len=6144, kv_capacity_tokens=6144))
    assert not first.serves_like(dataclasses.replace(first, fingerprint="def"))
    assert not first.serves_like(dataclasses.replace(first, vocab_size=32000))


def test_an_address_that_cannot_be_listened_on_is_refused_before_anything_loads(tiny_chat_model_dir):
    """A taken port (or a host that does not resolve) failed only after the model, kernels and caches had loaded,
    with uvicorn's message naming neither flag."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for host in ("127.0.0.1", "999.1.1.1"):
            started = time.monotonic()
            server = subprocess.run([sys.executable, "-m", "strata.server.cli", "serve", "--host", host, "--port",
                                     str(port), "--model", str(tiny_chat_model_dir)], capture_output=True, text=True,
                                    timeout=120)
            assert server.returncode == 2 and f"error: --host {host}" in server.stderr, server.stderr[-300:]
            assert "weights:" not in server.stderr and time.monotonic() - started < 60    # no engine was started


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_engine_process_exits_when_the_server_is_killed(tiny_chat_model_dir):
    server, url = start_cli_server("--no-request-cache", "--model", str(tiny_chat_model_dir), "--dtype", "fp32",
                                   "--kv-cache-memory", "64MiB", "--num-threads", "1")
    try:
        wait_healthy(server, url, 300)
        children = [int(pid) for pid in Path(f"/proc/{server.pid}/task/{server.pid}/children").read_text().split()]
        assert children                               # the engine process (and multiprocessing's helper)
    finally:
        server.kill()
        server.wait()
    assert all(wait_gone(pid, timeout=10) for pid in children), children      # no orphans


def test_an_engine_that_cannot_start_is_a_clear_error_from_strata_serve(tmp_path):
    started = time.monotonic()
    server = subprocess.run([sys.executable, "-m", "strata.server.cli", "serve", "--port", "0", "--no-request-cache",
                             "--model", str(tmp_path / "missing")], capture_output=True, text=True, timeout=300)
    assert server.returncode == 2 and time.monotonic() - started < 120
    last = server.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the engine did not start: FileNotFoundError:") and "does not exist" in last, last
    assert "Traceback" not in server.stderr     # a refused setting or file says what, not where in our code


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_sigterm_while_the_engine_loads_stops_both_processes_at_once(tiny_chat_model_dir):
    server = subprocess.Popen([sys.executable, "-m", "strata.server.cli", "serve", "--port", "0",
                               "--no-request-cache", "--model", str(tiny_chat_model_dir), "--dtype", "fp32",
                               "--kv-cache-memory", "64MiB"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        children_file = Path(f"/proc/{server.pid}/task/{server.pid}/children")
        deadline = time.monotonic() + 60
        while not (children := [int(pid) for pid in children_file.read_text().split()]):
            assert server.poll() is None and time.monotonic() < deadline, "no engine process started"
            time.sleep(0.05)
        stopped = time.monotonic()
        server.send_signal(signal.SIGTERM)             # the engine is still importing torch / loading the model
        assert server.wait(timeout=20) == 128 + signal.SIGTERM
        assert time.monotonic() - stopped < 20       # not the 30 s a "stop" command would wait for a loading engine
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert all(wait_gone(pid, timeout=10) for pid in children), children      # no orphan left loading


def test_the_startup_log_says_which_weight_format_the_engine_process_chose(tiny_chat_model_dir, tmp_path):
    """The engine process had no log handler: its INFO line naming the weight format never reached the log."""
    with open(tmp_path / "serve.log", "w") as log:
        server, url = start_cli_server("--no-request-cache", "--model", str(tiny_chat_model_dir), "--dtype", "fp32",
                                       "--quantization", "int8", "--kv-cache-memory", "64MiB", "--num-threads", "1",
                                       stderr=log)
        try:
            wait_healthy(server, url, 300)
        finally:
            server.terminate()
            server.wait(timeout=60)
    lines = (tmp_path / "serve.log").read_text().splitlines()
    assert any(" INFO strata.server.engine.llm_engine: weights: int8" in line for line in lines), lines[-10:]


def test_sigterm_to_the_whole_process_group_still_drains_requests_in_flight(tiny_chat_model_dir):
    """systemd's default stop signals every process of the service: the engine died at once and the requests in
    flight got 503, where a SIGTERM to the server alone lets them finish."""
    server, url = start_cli_server("--no-request-cache", "--model", str(tiny_chat_model_dir), "--dtype", "fp32",
                                   "--kv-cache-memory", "64MiB", "--num-threads", "1", "--shutdown-timeout-s", "60")
    try:
        wait_healthy(server, url, 300)
        children = [int(pid) for pid in Path(f"/proc/{server.pid}/task/{server.pid}/children").read_text().split()]
        body = {"model": tiny_chat_model_dir.name, "prompt": "Count:", "max_tokens": 1000, "ignore_eos": True,
                "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as res:
            chunks = res.iter_lines()
            assert res.status_code == 200 and next(chunks).startswith("data:")     # generating now
            for pid in [server.pid, *children]:           # what `kill -TERM -- -PGID` does
                os.kill(pid, signal.SIGTERM)
            rest = [line for line in chunks if line]
        assert rest[-1] == "data: [DONE]", rest[-3:]
        assert not any("error" in line for line in rest), [line for line in rest if "error" in line][:1]
        server.wait(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_sigterm_cuts_requests_still_running_after_the_shutdown_timeout(default_model_dir):
    """Draining had no limit: 4 long requests held a stopped server for 93 s, and a second SIGTERM did not help."""
    server, url = start_cli_server("--no-request-cache", "--model", str(default_model_dir), "--dtype", "fp32",
                                   "--kv-cache-memory", "128MiB", "--shutdown-timeout-s", "2")
    try:
        wait_healthy(server, url, 120)
        body = {"model": MODEL, "prompt": "Count:", "max_tokens": 2000, "ignore_eos": True, "temperature": 0}
        replies: list = []
        worker = threading.Thread(target=lambda: replies.append(httpx.post(url + "/v1/completions", json=body,
                                                                           timeout=120)), daemon=True)
        worker.start()                  # ~2,000 decode steps: a minute of work on a CPU
        time.sleep(2.0)
        stopped = time.monotonic()
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
        assert time.monotonic() - stopped < 15, "the shutdown waited for the request to finish"
        worker.join(10)                 # cut with a clean error, not a plain-text 500 (audit 14)
        assert replies and replies[0].status_code == 503, replies
        assert replies[0].json()["error"]["code"] == "engine_unavailable"
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
