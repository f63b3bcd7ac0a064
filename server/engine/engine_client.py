"""EngineClient: the HTTP process's handle on the engine process (server/engine/engine_process.py); it streams
outputs to asyncio callers and restarts the engine process when it dies.

Why a process: a decode step's Python code holds the GIL, and with the loop in a thread of the server every cache
hit waited for it (several times its idle latency under decode: docs/benchmarks.md). The engine process builds its
own LLMEngine from the EngineConfig (weights, KV pool and, on CUDA, its CUDA graphs) and owns scheduler and KV state.
Only the config, sequences, outputs and stats cross, so the HTTP process holds no model memory and no CUDA context,
and start-up pickles nothing big. The HTTP process loads the tokenizer while the engine loads; the engine then
reports its ModelInfo, or the error that stopped it (raised here as EngineStartError). Tokenizer and ModelInfo make
the InputProcessor with which the HTTP process validates and tokenizes every request itself: bad input fails before
any output, with the engine's own errors. Every update from the engine carries a stats snapshot, and `stats()`
returns the latest one (what /metrics, /status and /admin read).

Supervision: when the engine process dies (a crash, the OOM killer, kill -9), every request in flight fails with
EngineUnavailable (HTTP 503), new ones are refused the same way while a new engine process starts after a backoff,
and after more deaths than RestartPolicy allows within its window the client gives up (state "failed") and calls
`on_failed`, so that `strata serve` exits non-zero and systemd or Kubernetes restart it.
"""

import asyncio
import logging
import multiprocessing as mp
import signal
import threading
import time
import traceback
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from strata.server.engine.config import EngineConfig
from strata.server.engine.engine_process import EngineUpdate, engine_main
from strata.server.engine.input_processor import InputProcessor, ModelInfo, RequestError, load_tokenizer
from strata.server.engine.llm_engine import RequestOutput
from strata.server.engine.sequence import Sequence

PROGRESS_EVERY_S = 30          # a slow start says it is still loading this often
log = logging.getLogger("strata.engine")


class EngineStartError(RuntimeError):
    """The engine could not be built: the message names the cause in one line (what `strata serve` prints),
    `details` holds the traceback."""

    def __init__(self, cause: str, details: str = ""):
        super().__init__(f"the engine did not start: {cause}")
        self.details = details

    @classmethod
    def of(cls, exc: BaseException) -> "EngineStartError":
        return cls(traceback.format_exception_only(exc)[-1].strip(), "".join(traceback.format_exception(exc)))


class EngineUnavailable(RuntimeError):
    """The engine process is down (restarting, or given up): the request was not, or not fully, served."""

    def __init__(self, message: str, retry_after_s: float | None):
        super().__init__(message)
        self.retry_after_s = retry_after_s       # None: it will not come back (the server is shutting down)


class EngineRequestFailed(RuntimeError):
    """The engine failed this one request (finish_reason "error"); the others went on."""


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """How often a dead engine process is restarted before the server gives up."""

    max_restarts: int = 3            # deaths tolerated within window_s; one more and the client fails
    window_s: float = 300.0
    backoff_s: float = 1.0           # first delay before a restart, doubled after each death in the window
    max_backoff_s: float = 30.0
    start_timeout_s: float = 600.0   # a start or restart that reports no engine by then has failed
    stall_s: float = 0.0             # no step for this long while requests wait: killed as wedged, restarted; 0 never

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.window_s <= 0 or self.backoff_s < 0 or self.max_backoff_s < self.backoff_s:
            raise ValueError("need max_restarts >= 0, window_s > 0 and 0 <= backoff_s <= max_backoff_s")
        if not 0 <= self.stall_s < float("inf"):
            raise ValueError(f"the stall limit must be a finite number of seconds >= 0 (0: never), got {self.stall_s}")
        if not 0 < self.start_timeout_s < float("inf"):
            raise ValueError(f"the start timeout must be a finite number of seconds > 0, got {self.start_timeout_s}")


@contextmanager
def sigint_ignored():
    """SIGINT ignored while a child is spawned, so the child starts with it ignored (the engine process leaves Ctrl-C
    to the server, which stops it); only the main thread may change it, and restarts spawn from another."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class EngineProcess:
    """One engine process and the thread that reads its updates; `dead` is set when it is gone."""

    def __init__(self, config: EngineConfig, num_threads: int, on_update: Callable[[EngineUpdate], None]):
        ctx = mp.get_context("spawn")
        self.commands = ctx.Queue()          # its feeder thread sends, so a put never blocks the event loop
        self.updates, child_end = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=engine_main, name="strata-engine", daemon=True,
                                   args=(config, self.commands, child_end, num_threads))
        self._child_end = child_end
        self.on_update = on_update
        self.info: ModelInfo | None = None
        self.error: BaseException | None = None
        self.spawned = time.monotonic()
        self.load_s: float | None = None     # from the spawn to its ModelInfo: how long a start takes here
        self.ready = threading.Event()       # ModelInfo came, or the process is gone
        self.dead = threading.Event()
        self.stopping = False                # stop() was called: the reader takes EOF as asked for, start() refuses
        # the supervisor (restarting) and the server's shutdown may start and stop one process at once: the shutdown
        # can stop it before the supervisor starts it (it must then stay down), or both stop it together
        self._stop_lock = threading.Lock()
        self.reader = threading.Thread(target=self._read, name="strata-engine-reader", daemon=True)

    def start(self) -> None:
        """Start the process and its reader; one stopped before it started stays down (dead and ready at once)."""
        with self._stop_lock:
            if self.stopping:
                self.error = self.error or RuntimeError("the engine process was stopped before it started")
                self.dead.set()
                self.ready.set()
                return
            self.spawned = time.monotonic()
            with sigint_ignored():              # inherited through the spawn: Ctrl-C during the child's imports
                self.process.start()            # printed a KeyboardInterrupt traceback from it
            self._child_end.close()          # so the reader sees EOF when the engine process dies
            self.reader.start()

    def send(self, command: str, arg) -> None:
        """Queue a command for the process; dropped once it is gone or stopped (nobody would read it)."""
        if self.dead.is_set():
            return
        try:
            self.commands.put((command, arg))
        except ValueError:                   # a concurrent stop() closed the queue
            pass

    def stop(self) -> None:
        """Stop the process (killed if it does not finish its step in time) and the reader; idempotent, and safe to
        call from two threads at once."""
        with self._stop_lock:
            if not self.stopping:
                self.stopping = True
                self._end_process()
        if self.reader.is_alive() and self.reader is not threading.current_thread():
            self.reader.join(timeout=30)

    def kill_wedged(self, why: str) -> None:
        """Kill a process that stopped stepping (SIGKILL reaches a stopped one too); its reader then sees it die with
        `why` as the error, and the supervisor restarts it like any dead one."""
        self.error = RuntimeError(why)
        self.process.kill()

    def _end_process(self) -> None:
        if self.process.is_alive() and not self.ready.is_set():
            self.process.kill()                # still loading: it reads no command until it is built
            self.process.join()
        if self.process.is_alive():
            self.commands.put(("stop", None))
            self.process.join(timeout=30)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
        self.commands.cancel_join_thread()   # commands the engine never read are moot now
        self.commands.close()

    def _read(self) -> None:
        try:
            while True:
                try:
                    update: EngineUpdate = self.updates.recv()
                except (EOFError, OSError):
                    if not self.stopping:
                        self.process.join(timeout=5)
                        exited = f"engine process exited (exit code {self.process.exitcode})"
                        self.error = self.error or (RuntimeError(exited) if self.ready.is_set()
                                                    else EngineStartError(exited))
                    return
                if update.crash is not None:
                    last = update.crash.strip().splitlines()[-1]
                    log.error("engine process failed:\n%s", update.crash)
                    self.error = (RuntimeError(f"engine process failed: {last}") if self.ready.is_set()
                                  else EngineStartError(last, update.crash))
                    return
                if update.info is not None:
                    self.info = update.info
                    self.load_s = time.monotonic() - self.spawned
                    self.ready.set()
                self.on_update(update)
        finally:
            self.dead.set()
            self.ready.set()


class EngineClient:
    """One engine process at a time per server. `start` spawns it, `wait_ready` returns the InputProcessor the
    server validates with (start-up errors surface there) and starts supervising, `stop` ends it.

    `state`: "starting" (first start, or a restart after a death), "ok", "failed" (gave up), "stopped".
    """

    def __init__(self, config: EngineConfig, restart: RestartPolicy | None = None,
                 on_failed: Callable[[str], None] | None = None):
        self.config = config
        self.restart = restart or RestartPolicy()
        self.on_failed = on_failed
        self.num_threads = torch.get_num_threads()
        self.model_path: Path | None = None
        self.inputs: InputProcessor | None = None
        self.info: ModelInfo | None = None
        self.streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.snapshot: dict[str, float] = {}
        self.last_update = time.monotonic()     # the engine's latest report (one per step)
        self.busy_since = time.monotonic()      # when requests started waiting, after none did
        self.state = "starting"
        self.reason = "loading the model"        # why the state is what it is, in a few words (for /health)
        self.restarts = 0
        self.restart_at: float | None = None     # when the pending restart spawns its process
        self.load_s: float | None = None         # how long the latest successful start took
        self.deaths: deque[float] = deque()
        self.wake = threading.Event()            # stop() interrupts a backoff
        self.current = EngineProcess(config, self.num_threads, self._on_update)
        self.supervisor = threading.Thread(target=self._supervise, name="strata-engine-supervisor", daemon=True)

    @property
    def process(self) -> mp.Process:
        """The current engine process."""
        return self.current.process

    @property
    def error(self) -> BaseException | None:
        return self.current.error

    @property
    def alive(self) -> bool:
        return self.state == "ok"

    @property
    def num_pending(self) -> int:
        """Requests accepted and not yet finished (what an overload check compares to its limit)."""
        return len(self.streams)

    def retry_after_s(self) -> float | None:
        """When a refused client should try again: None once the engine will not come back; while it restarts, the
        backoff left plus how long the last start took (a restart took 6-11 s while 1 s was advised)."""
        if self.state in ("failed", "stopped"):
            return None
        if self.state == "starting" and self.restart_at is not None:
            return max(1.0, self.restart_at - time.monotonic() + (self.load_s or 0.0))
        return max(1.0, self._backoff())

    def start(self) -> None:
        """Spawn the engine process, which builds the engine while the caller loads other things. The default model
        is converted here first (on first use only), so that two processes never convert it at once."""
        try:
            self.model_path = self.config.resolve_model_path()
        except OSError as exc:
            raise EngineStartError.of(exc) from exc
        self.current.start()

    def wait_ready(self) -> InputProcessor:
        """Load the tokenizer here while the engine process builds the engine, then wait for its ModelInfo (saying
        every PROGRESS_EVERY_S that it is still loading: a first start converts the model and builds kernels);
        EngineStartError (engine process stopped) if either fails or none comes within the start timeout."""
        try:
            tokenizer = load_tokenizer(self.config, self.model_path)
        except (OSError, ValueError) as exc:
            self.stop()
            raise EngineStartError.of(exc) from exc
        timeout = self.restart.start_timeout_s
        deadline = time.monotonic() + timeout
        while not self.current.ready.wait(max(0.0, min(PROGRESS_EVERY_S, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                self.stop()
                raise EngineStartError(f"no engine within {timeout:.0f} s (--engine-start-timeout-s)")
            log.info("the engine is still loading (%.0f s of --engine-start-timeout-s %.0f)",
                     timeout - (deadline - time.monotonic()), timeout)
        if self.current.info is None:     # the reader gave up before any ModelInfo came: its error says why
            error = self.current.error
            self.stop()
            raise error
        self.info = self.current.info
        self.load_s = self.current.load_s
        self.inputs = InputProcessor(self.info, tokenizer)
        self.state, self.reason = "ok", ""
        self.supervisor.start()
        return self.inputs

    def stop(self) -> None:
        """Stop the engine process and supervision; idempotent."""
        self.state, self.reason = "stopped", "server shutting down"
        self.wake.set()
        self.current.stop()
        self._fail_streams(EngineUnavailable("the server is shutting down", None))
        if self.supervisor.is_alive() and self.supervisor is not threading.current_thread():
            self.supervisor.join(timeout=60)

    def refuse_in_flight(self, why: str) -> None:
        """Fail every request in flight with EngineUnavailable(why), each aborted in the engine: a shutdown whose
        grace is running out answers them with a clean 503 rather than have uvicorn cut their connections. Safe on
        the event loop (it does not wait); stop() still ends the process."""
        self.state, self.reason = "stopped", why
        self._fail_streams(EngineUnavailable(why, None))

    def stats(self) -> dict[str, float]:
        """The engine's counters (KV blocks, prefix cache, preemptions, swap) as of its latest update."""
        return self.snapshot

    def check_available(self) -> None:
        """EngineUnavailable unless the engine takes requests now (callers check before promising a stream)."""
        if self.state != "ok":
            raise EngineUnavailable(f"the engine is {self.state}: {self.reason}", self.retry_after_s())

    async def submit(self, seq: Sequence) -> AsyncIterator[RequestOutput]:
        """Stream outputs of a validated sequence; leaving early (client gone) aborts it, which frees its blocks.
        EngineRequestFailed when the engine failed this request, EngineUnavailable when the engine went down."""
        self.check_available()
        engine = self.current
        outputs: asyncio.Queue = asyncio.Queue()
        if not self.streams:
            self.busy_since = time.monotonic()
        self.streams[seq.request_id] = (asyncio.get_running_loop(), outputs)
        engine.send("add", seq)
        finished = False
        try:
            if engine.dead.is_set():        # it died before the add: the supervisor may have failed the streams it
                raise EngineUnavailable("the engine process died; it is restarting",   # saw before this one
                                        self.retry_after_s())
            while True:
                out = await outputs.get()
                if isinstance(out, BaseException):
                    raise out
                if out.finish_reason == "error":
                    finished = True
                    raise EngineRequestFailed(out.error or "the engine failed this request")
                yield out
                if out.finished:
                    finished = True
                    return
        finally:
            self.streams.pop(seq.request_id, None)
            if not finished and engine is self.current:
                engine.send("abort", seq.request_id)

    # ---- the engine process's side ---------------------------------------------------------------------

    def stalled_for(self) -> float:
        """Seconds the engine has reported nothing while requests wait on it (0 when none waits): a stopped or
        wedged process, or a step far slower than any should be."""
        if not self.streams or self.state != "ok":
            return 0.0
        return time.monotonic() - max(self.last_update, self.busy_since)

    def _on_update(self, update: EngineUpdate) -> None:
        """Reader thread: hand each update's outputs to their streams."""
        self.snapshot = update.stats
        self.last_update = time.monotonic()
        self._deliver([(out.request_id, out) for out in update.outputs] +
                      [(request_id, RequestError(why)) for request_id, why in update.refused.items()])

    def _supervise(self) -> None:
        """Wait for the engine process to die; then fail what was in flight and restart it, within the policy."""
        while True:
            self._wait_dead()
            if self.state == "stopped":
                return
            why = str(self.current.error or "engine process stopped")
            log.error("%s; %d request(s) in flight fail with 503", why, len(self.streams))
            now = time.monotonic()
            self.deaths.append(now)
            while self.deaths and now - self.deaths[0] > self.restart.window_s:
                self.deaths.popleft()
            if len(self.deaths) > self.restart.max_restarts:
                self._give_up(f"{why}; {len(self.deaths)} engine deaths within {self.restart.window_s:.0f} s")
                return
            self.state, self.reason = "starting", f"restarting after: {why}"
            self.restart_at = now + self._backoff()
            self._fail_streams(EngineUnavailable(f"the engine process died ({why}); it is restarting",
                                                 self.retry_after_s()))
            if self.wake.wait(self._backoff()) or self.state == "stopped":
                return
            self._restart()

    def _wait_dead(self) -> None:
        """Until the current engine process dies. One that reports no step for the policy's stall_s while requests
        wait is killed first: a wedged process otherwise holds every request until its client gives up."""
        engine, limit = self.current, self.restart.stall_s
        while not engine.dead.wait(min(1.0, limit / 4) if limit else None):
            stalled = self.stalled_for()
            if stalled >= limit:
                why = (f"the engine reported no step for {stalled:.0f} s while {len(self.streams)} request(s) waited "
                       f"(limit {limit:g} s): killed as wedged")
                engine.kill_wedged(why)         # logged below, as any death, with the requests it fails
                engine.dead.wait()

    def _backoff(self) -> float:
        deaths = max(len(self.deaths), 1)
        return min(self.restart.backoff_s * 2 ** (deaths - 1), self.restart.max_backoff_s)

    def _restart(self) -> None:
        """A new engine process; it must report the same model (fingerprint) the server validates against."""
        self.current.stop()
        engine = EngineProcess(self.config, self.num_threads, self._on_update)
        self.current = engine
        engine.start()
        came_up = engine.ready.wait(self.restart.start_timeout_s)
        if self.state == "stopped":
            engine.stop()
            return
        if not came_up:                     # still loading: killed, and counted as one more death (it was left
            engine.kill_wedged(f"the restarted engine did not come up within {self.restart.start_timeout_s:g} s "
                               "(--engine-start-timeout-s)")    # loading, the server "starting" for good)
            return
        if engine.info is None:             # died while starting: the loop counts it as one more death
            engine.error = engine.error or RuntimeError("the restarted engine process did not come up")
            return
        if not engine.info.serves_like(self.info):
            engine.error = RuntimeError("the restarted engine reports another model than the server validates for")
            engine.stop()
            return
        self.inputs.info = self.info = engine.info      # the KV capacity may differ with the memory free now
        self.load_s, self.restart_at = engine.load_s, None
        self.restarts += 1
        self.state, self.reason = "ok", ""
        log.info("engine process restarted (%d restart(s) so far)", self.restarts)

    def _give_up(self, why: str) -> None:
        self.state, self.reason = "failed", why
        log.critical("giving up on the engine: %s", why)
        self._fail_streams(EngineUnavailable(f"the engine failed for good ({why})", None))
        if self.on_failed is not None:
            self.on_failed(why)

    def _fail_streams(self, error: BaseException) -> None:
        self._deliver([(request_id, error) for request_id in list(self.streams)])

    def _deliver(self, items: list[tuple[str, object]]) -> None:
        """One wake-up per event loop for a whole step's outputs: each wake-up costs the HTTP loop a turn."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        for request_id, item in items:
            stream = self.streams.get(request_id)
            if stream is not None:
                by_loop.setdefault(stream[0], []).append((stream[1], item))
        for loop, puts in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, puts)
            except RuntimeError:    # that caller's event loop has closed: nobody is listening
                pass


def _put_all(puts: list[tuple[asyncio.Queue, object]]) -> None:
    for outputs, item in puts:
        outputs.put_nowait(item)
