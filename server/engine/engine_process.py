"""The engine process: builds its own LLMEngine from the EngineConfig, then applies commands between steps and sends
outputs + stats back to the HTTP process (server/engine/engine_client.py is the other end)."""

import logging
import multiprocessing as mp
import os
import queue
import signal
import traceback
from dataclasses import dataclass, field

import torch

from strata.server.engine.config import EngineConfig
from strata.server.engine.input_processor import ModelInfo
from strata.server.engine.llm_engine import LLMEngine, RequestOutput

IDLE_WAIT_S = 0.5          # an idle engine process checks this often that the server still lives


@dataclass(slots=True)
class EngineUpdate:
    """What the engine process sends: first its ModelInfo (or a crash), then one per step or batch of commands."""

    outputs: list[RequestOutput]
    stats: dict[str, float]
    refused: dict[str, str] = field(default_factory=dict)   # request id -> why enqueue refused it
    crash: str | None = None                                # traceback of a failed start or step; the process exits
    info: ModelInfo | None = None                           # only in the first update, once the engine is built



def lower_priority(nice: int) -> None:
    """Renice every thread of this process: Linux nice is per thread, and os.nice() alone left the OpenMP workers
    (started while loading) at full priority, taking the cores from the HTTP process."""
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else [0]:
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), max(os.getpriority(os.PRIO_PROCESS, int(tid)), nice))
        except (ProcessLookupError, PermissionError):   # exited meanwhile, or not ours to renice
            pass


def configure_logging() -> None:
    """INFO and above to stderr, one format in both processes of `strata serve` (and in `strata generate`): a spawned
    engine process starts with no handler, and its lines (the weight format chosen, warnings) were dropped."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def engine_main(config: EngineConfig, commands, updates, num_threads: int) -> None:
    """The engine process: build the engine, report its ModelInfo (or why it failed), then apply commands between
    steps, step while work remains, send outputs + stats.

    It exits on "stop", when the server process is gone (no orphans), or after reporting a failed start or step.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # Ctrl-C reaches the whole group; the server stops us
    configure_logging()
    torch.set_num_threads(num_threads)
    server = mp.parent_process()
    try:
        engine = LLMEngine(config)
    except (ValueError, OSError) as exc:   # a setting or a file refused with its own message: no traceback to read
        updates.send(EngineUpdate([], {}, crash=f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None
    except BaseException:
        updates.send(EngineUpdate([], {}, crash=traceback.format_exc()))
        raise SystemExit(1) from None
    lower_priority(config.engine_nice)  # after loading: the server waits for that, so it runs at full priority
    # loaded: from now on the server alone stops us ("stop", or a kill past its drain). A SIGTERM to the whole group
    # (systemd's default stop) killed the engine before the server drained, failing every request in flight
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    updates.send(EngineUpdate([], engine.stats(), info=engine.info))
    while server.is_alive():
        refused: dict[str, str] = {}
        applied = False
        try:
            command, arg = commands.get_nowait() if engine.has_unfinished() else commands.get(timeout=IDLE_WAIT_S)
            while True:
                if command == "stop":
                    return
                if command == "add":
                    try:
                        engine.enqueue(arg)
                    except ValueError as exc:
                        refused[arg.request_id] = str(exc)
                else:
                    engine.abort(arg)
                applied = True
                command, arg = commands.get_nowait()
        except queue.Empty:
            pass
        outputs, stepped = [], engine.has_unfinished()
        if stepped:
            try:
                outputs = engine.step()
            except BaseException:
                updates.send(EngineUpdate([], engine.stats(), refused, crash=traceback.format_exc()))
                raise
        if outputs or applied or stepped:       # every step reports, a prefill chunk without output too: the
            updates.send(EngineUpdate(outputs, engine.stats(), refused))    # server tells a slow step from a stall
