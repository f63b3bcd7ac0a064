"""Runs the engine loop in one background thread and streams outputs to asyncio callers (the HTTP server).

Only that thread touches scheduler state; callers validate on their own thread and hand sequences over
through a queue, so the event loop never waits for a model step.
"""

import asyncio
import queue
import threading
from collections.abc import AsyncIterator

from strata.server.llm_engine import LLMEngine, RequestOutput
from strata.server.sampling_params import SamplingParams
from strata.server.sequence import Sequence


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.commands: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self.streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.wakeup = threading.Event()
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name="strata-engine", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping = True
        self.wakeup.set()
        self.thread.join(timeout=30)

    @property
    def num_pending(self) -> int:
        """Requests accepted and not yet finished (what an overload check compares to its limit)."""
        return len(self.streams)

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                       chat: bool = False) -> AsyncIterator[RequestOutput]:
        """Stream outputs of one request; raises RequestError before the first output on bad input.

        Leaving the iteration early (client gone) aborts the request and frees its blocks.
        """
        seq = self.engine.make_sequence(prompt, params, request_id, chat)
        async for out in self.submit(seq):
            yield out

    async def submit(self, seq: Sequence) -> AsyncIterator[RequestOutput]:
        if self.error is not None:
            raise RuntimeError("engine loop has stopped") from self.error
        outputs: asyncio.Queue = asyncio.Queue()
        self.streams[seq.request_id] = (asyncio.get_running_loop(), outputs)
        self.commands.put(("add", seq))
        self.wakeup.set()
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
            if not finished:
                self.commands.put(("abort", seq.request_id))
                self.wakeup.set()

    def _loop(self) -> None:
        engine = self.engine
        while not self.stopping:
            self._drain_commands()
            if not engine.has_unfinished():
                self.wakeup.wait(timeout=0.5)
                self.wakeup.clear()
                continue
            try:
                outputs = engine.step()
            except BaseException as exc:  # a broken step fails every request in flight, loudly
                self.error = exc
                for request_id in list(engine.requests):
                    engine.abort(request_id)
                    self._deliver(request_id, exc)
                raise
            for out in outputs:
                self._deliver(out.request_id, out)

    def _drain_commands(self) -> None:
        while True:
            try:
                command, arg = self.commands.get_nowait()
            except queue.Empty:
                return
            if command == "add":
                try:
                    self.engine.enqueue(arg)
                except ValueError as exc:
                    self._deliver(arg.request_id, exc)
            else:
                self.engine.abort(arg)

    def _deliver(self, request_id: str, item: object) -> None:
        stream = self.streams.get(request_id)
        if stream is not None:
            loop, outputs = stream
            loop.call_soon_threadsafe(outputs.put_nowait, item)
