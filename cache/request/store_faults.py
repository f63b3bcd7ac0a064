"""Store faults as plain data: a failing store call is one log line and a counter, never a failed request; the cache
says "degraded" while faults are recent."""
from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from strata.cache.request.stats import CacheStats

log = logging.getLogger(__name__)

RECENT_S = 60.0         # a fault this recent makes health() "degraded"; also the quiet time between two log lines


class StoreFaults:
    """Counts store faults ("store.error"), logs at most one line per operation and RECENT_S (with how many it held
    back), and keeps their times for health(). Thread-safe: the event loop's workers and the writer both report."""

    def __init__(self, stats: CacheStats, clock: Callable[[], float], recent_s: float = RECENT_S):
        self.stats = stats
        self.clock = clock
        self.recent_s = recent_s
        self.times: deque[float] = deque()
        self.last = ""                                  # "operation: error" of the latest fault
        self.logged: dict[str, tuple[float, int]] = {}  # operation -> (last log time, faults held back since)
        self.lock = threading.Lock()

    @contextmanager
    def watch(self, operation: str) -> Iterator[None]:
        """Report a fault of the block, then let it propagate (for callers that must not pretend it worked)."""
        try:
            yield
        except Exception as exc:
            self.report(operation, exc)
            raise

    def call(self, operation: str, fn: Callable[..., Any], *args: Any, default: Any = None) -> Any:
        """fn(*args), or `default` when it fails (reported): a store lookup that fails is a miss."""
        try:
            with self.watch(operation):
                return fn(*args)
        except Exception:
            return default

    def report(self, operation: str, exc: BaseException) -> None:
        """Count and remember one fault; log it unless this operation was logged less than recent_s ago."""
        now = self.clock()
        message = f"{operation}: {type(exc).__name__}: {exc}"[:200]
        self.stats.count("store.error")
        with self.lock:
            self.times.append(now)
            self.last = message
            logged_at, held = self.logged.get(operation, (float("-inf"), 0))
            quiet = now - logged_at < self.recent_s
            self.logged[operation] = (logged_at, held + 1) if quiet else (now, 0)
        if not quiet:
            more = f" (+{held} more since the last line)" if held else ""
            log.warning("request-cache store fault, served as a miss: %s%s", message, more)

    def resolved(self) -> None:
        """The store just proved itself end to end (a shared store's resync after an outage): the faults before now
        are over, so health() stops saying "degraded" for them. The counter and the latest message stay."""
        with self.lock:
            self.times.clear()

    def recent(self) -> int:
        """How many faults happened in the last recent_s."""
        now = self.clock()
        with self.lock:
            while self.times and now - self.times[0] >= self.recent_s:
                self.times.popleft()
            return len(self.times)
