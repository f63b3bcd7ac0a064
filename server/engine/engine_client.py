"""EngineClient: the HTTP process's handle on the engine process (server/engine/engine_process.py); it streams
outputs to asyncio callers.

Why a process: a decode step's Python code holds the GIL, and with the loop in a thread of the server every cache
hit waited for it (several times its idle latency under decode: docs/benchmarks.md). The engine process builds its own LLMEngine
from the EngineConfig (weights, KV pool and, on CUDA, its CUDA graphs) and owns scheduler and KV state. Only the
config, sequences, outputs and stats cross, so the HTTP process holds no model memory and no CUDA context, and
start-up pickles nothing big. The HTTP process loads the tokenizer while the engine loads; the engine then reports
its ModelInfo, or the error that stopped it (raised here as EngineStartError). Tokenizer and ModelInfo make the
InputProcessor with which the HTTP process validates and tokenizes every request itself: bad input fails before
any output, with the engine's own errors. Every update from the engine carries a stats snapshot, and `stats()`
returns the latest one (what /metrics, /status and /admin read).
"""

import asyncio
import multiprocessing as mp
import threading
import traceback
from collections.abc import AsyncIterator
from pathlib import Path

import torch

from strata.server.engine.config import EngineConfig
from strata.server.engine.engine_process import EngineUpdate, engine_main
from strata.server.engine.input_processor import InputProcessor, ModelInfo, RequestError, load_tokenizer
from strata.server.engine.llm_engine import RequestOutput
from strata.server.engine.sequence import Sequence

START_TIMEOUT_S = 600


class EngineStartError(RuntimeError):
    """The engine could not be built: the message names the cause in one line (what `strata serve` prints),
    `details` holds the traceback."""

    def __init__(self, cause: str, details: str = ""):
        super().__init__(f"the engine did not start: {cause}")
        self.details = details

    @classmethod
    def of(cls, exc: BaseException) -> "EngineStartError":
        return cls(traceback.format_exception_only(exc)[-1].strip(), "".join(traceback.format_exception(exc)))


class EngineClient:
    """One engine process per server. `start` spawns it, `wait_ready` returns the InputProcessor the server
    validates with (its errors surface there), `stop` ends it."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_path: Path | None = None
        self.inputs: InputProcessor | None = None
        self.streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.error: BaseException | None = None
        self.snapshot: dict[str, float] = {}
        self.info: ModelInfo | None = None
        ctx = mp.get_context("spawn")
        self.commands = ctx.Queue()          # its feeder thread sends, so a put never blocks the event loop
        self.updates, child_end = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=engine_main, name="strata-engine", daemon=True,
                                   args=(config, self.commands, child_end, torch.get_num_threads()))
        self._child_end = child_end
        self.ready = threading.Event()
        self.stopping = False
        self.reader = threading.Thread(target=self._read, name="strata-engine-reader", daemon=True)

    def start(self) -> None:
        """Spawn the engine process, which builds the engine while the caller loads other things. The default model
        is converted here first (on first use only), so that two processes never convert it at once."""
        try:
            self.model_path = self.config.resolve_model_path()
        except OSError as exc:
            raise EngineStartError.of(exc) from exc
        self.process.start()
        self._child_end.close()              # so the reader sees EOF when the engine process dies
        self.reader.start()

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> InputProcessor:
        """Load the tokenizer here while the engine process builds the engine, then wait for its ModelInfo;
        EngineStartError (engine process stopped) if either fails."""
        try:
            tokenizer = load_tokenizer(self.config, self.model_path)
        except (OSError, ValueError) as exc:
            self.stop()
            raise EngineStartError.of(exc) from exc
        if not self.ready.wait(timeout):
            self.stop()
            raise EngineStartError(f"no engine within {timeout:.0f} s")
        if self.info is None:     # the reader gave up before any ModelInfo came: self.error says why
            self.stop()
            raise self.error
        self.inputs = InputProcessor(self.info, tokenizer)
        return self.inputs

    def stop(self) -> None:
        """Stop the engine process (killed if it does not finish its step in time) and the reader; idempotent."""
        self.stopping = True
        if self.process.is_alive():
            self.commands.put(("stop", None))
            self.process.join(timeout=30)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
        self.commands.cancel_join_thread()   # commands the engine never read are moot now
        self.commands.close()
        if self.reader.is_alive():
            self.reader.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self.error is None and self.process.is_alive()

    @property
    def num_pending(self) -> int:
        """Requests accepted and not yet finished (what an overload check compares to its limit)."""
        return len(self.streams)

    def stats(self) -> dict[str, float]:
        """The engine's counters (KV blocks, prefix cache, preemptions, swap) as of its latest update."""
        return self.snapshot

    async def submit(self, seq: Sequence) -> AsyncIterator[RequestOutput]:
        """Stream outputs of a validated sequence; leaving early (client gone) aborts it, which frees its blocks."""
        if self.error is not None:
            raise RuntimeError("engine process has stopped") from self.error
        outputs: asyncio.Queue = asyncio.Queue()
        self.streams[seq.request_id] = (asyncio.get_running_loop(), outputs)
        self.commands.put(("add", seq))
        finished = False
        try:
            while True:
                out = await outputs.get()
                if isinstance(out, BaseException):
                    raise out
                yield out
                if out.finished:
                    finished = True
                    return
        finally:
            self.streams.pop(seq.request_id, None)
            if not finished and self.error is None:
                self.commands.put(("abort", seq.request_id))

    def _read(self) -> None:
        """Reader thread: hand each update's outputs to their streams; a dead engine fails every stream, loudly."""
        while self.error is None:
            try:
                update: EngineUpdate = self.updates.recv()
            except (EOFError, OSError):
                if self.stopping:
                    break
                self.process.join(timeout=5)
                exited = f"engine process exited (exit code {self.process.exitcode})"
                self.error = RuntimeError(exited) if self.ready.is_set() else EngineStartError(exited)
                break
            self.snapshot = update.stats
            if update.crash is not None:
                if self.ready.is_set():
                    self.error = RuntimeError(f"engine step failed in the engine process:\n{update.crash}")
                else:
                    self.error = EngineStartError(update.crash.strip().splitlines()[-1], update.crash)
                break
            if update.info is not None:
                self.info = update.info
                self.ready.set()
            self._deliver([(out.request_id, out) for out in update.outputs] +
                          [(request_id, RequestError(why)) for request_id, why in update.refused.items()])
        self._deliver([(request_id, self.error) for request_id in list(self.streams)])
        self.ready.set()

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
