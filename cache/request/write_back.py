"""Write-back: one worker thread drains a bounded queue, so the caller never waits for a cache write."""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)
_STOP = object()


class WriteBack:
    """submit() never blocks: a full queue drops the job (the caller counts it); a failing job is logged, not fatal."""

    def __init__(self, handle: Callable[[object], None], size: int, idle: Callable[[], None] = lambda: None):
        self.handle = handle
        self.idle = idle                    # runs whenever the queue empties (e.g. persist hit counts)
        self.queue: queue.Queue = queue.Queue(maxsize=size)
        self.errors = 0
        self.thread = threading.Thread(target=self.run, name="request-cache-writer", daemon=True)
        self.thread.start()

    def submit(self, job: object) -> bool:
        """Queue a job; False when the queue is full (the write is dropped) or closed."""
        if not self.thread.is_alive():
            return False
        try:
            self.queue.put_nowait(job)
            return True
        except queue.Full:
            return False

    def run(self) -> None:
        """Worker loop: one job at a time until close()."""
        while True:
            job = self.queue.get()
            try:
                if job is _STOP:
                    return
                self.handle(job)
                if self.queue.empty():
                    self.idle()
            except Exception:
                self.errors += 1
                log.exception("request-cache write failed")
            finally:
                self.queue.task_done()

    def join(self) -> None:
        """Block until every queued job is done."""
        if self.thread.is_alive():
            self.queue.join()

    def close(self) -> None:
        """Finish queued jobs, then stop the worker."""
        if self.thread.is_alive():
            self.queue.put(_STOP)
            self.thread.join()
