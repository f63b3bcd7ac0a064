"""Circuit breaker of the Redis link: after a few connection failures in a row every call short-circuits (no retry
storm against a Redis that is down or slow) until the stream follower's probe finds it back and has resynced."""
from __future__ import annotations

import threading
import time


class Breaker:
    """Closed (up) or open (down). Opens after `failures` consecutive connection errors; only close() reopens the
    link, once the queued writes are flushed and the index resynced (redis_sync.py)."""

    def __init__(self, failures: int = 3):
        self.failures = failures
        self.up = False             # closed once the first sync ran
        self.run = 0                # consecutive failures
        self.down_since: float | None = time.monotonic()
        self.last_error = "not connected yet"
        self.errors = 0             # connection errors, all time
        self.lock = threading.Lock()

    def success(self) -> None:
        with self.lock:
            self.run = 0

    def failure(self, exc: BaseException, *, trip: bool = False) -> None:
        """Count one connection error; open after `failures` in a row, or at once with trip (the stream is gone)."""
        with self.lock:
            self.errors += 1
            self.run += 1
            self.last_error = f"{type(exc).__name__}: {exc}"[:200]
            if self.up and (trip or self.run >= self.failures):
                self.up, self.down_since = False, time.monotonic()

    def close(self) -> None:
        with self.lock:
            self.up, self.run, self.down_since = True, 0, None

    def down_for(self) -> float:
        """Seconds since the link went down (0 while up)."""
        since = self.down_since
        return 0.0 if since is None else time.monotonic() - since
