"""Penetration guard and negative cache: near-identical misses from one client and repeated failures stop costing work."""
from __future__ import annotations

import re
from collections.abc import Callable

from cachetools import TTLCache

from strata.cache.request.keys import RequestKey

_DIGITS = re.compile(r"\d+")


def cluster_of(key: RequestKey) -> str:
    """Requests that differ only in numbers or templated entities ("for 10 people" / "for 11 people") share a cluster."""
    return key.partition + "\x00" + _DIGITS.sub("#", key.text.casefold())


class MissGuard:
    """A client that misses one cluster more than `limit` times within `window_s` gets a "recently missed" mark:
    its requests in that cluster skip the semantic lookup (no embedding) and are not written, until the mark lapses.
    Failures are remembered for `negative_ttl_s`, so the same request gets the error at once instead of recomputing.
    """

    def __init__(self, window_s: float, limit: int, negative_ttl_s: float, clock: Callable[[], float],
                 max_keys: int = 100_000):
        self.limit = limit
        self.misses: TTLCache[tuple[str, str], int] = TTLCache(max_keys, window_s, timer=clock)
        self.failures: TTLCache[str, Exception] = TTLCache(max_keys, max(negative_ttl_s, 1e-9), timer=clock)
        self.negative_ttl_s = negative_ttl_s

    def marked(self, client_id: str | None, key: RequestKey) -> bool:
        """True while this client's cluster carries the recently-missed mark."""
        return client_id is not None and self.misses.get((client_id, cluster_of(key)), 0) > self.limit

    def note_miss(self, client_id: str | None, key: RequestKey) -> None:
        """Count one miss of this client's cluster (each miss extends the window)."""
        if client_id is not None:
            slot = (client_id, cluster_of(key))
            self.misses[slot] = self.misses.get(slot, 0) + 1

    def note_failure(self, flight_key: str, exc: Exception) -> None:
        """Remember a failed computation for a short while."""
        if self.negative_ttl_s > 0:
            self.failures[flight_key] = exc

    def failure(self, flight_key: str) -> Exception | None:
        """The recent failure of this exact request, if any."""
        return self.failures.get(flight_key)

    def forget_failure(self, flight_key: str) -> None:
        """A success clears the failure mark."""
        self.failures.pop(flight_key, None)
