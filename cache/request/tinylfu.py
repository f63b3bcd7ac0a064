"""W-TinyLFU in-process layer (theine) for replicas in front of a shared store: admission by frequency keeps the
questions many users repeat when one-off questions stream past, which an LRU would let them evict."""
from __future__ import annotations

import threading
from collections.abc import Callable

from theine import Cache

from strata.cache.request.store import Entry


class TinyLFU:
    """theine bounds the entries; a byte account of what was put (oldest first) bounds the bytes: past max_bytes,
    the sizes of what W-TinyLFU already evicted are forgotten, then the oldest writes go."""

    def __init__(self, max_entries: int, max_bytes: int, clock: Callable[[], float]):
        self.max_entries, self.max_bytes, self.clock = max_entries, max_bytes, clock
        self.cache: Cache[str, Entry] = Cache(max_entries)
        self.sizes: dict[str, int] = {}     # entry id -> bytes, in write order; may still hold evicted ids
        self.bytes = 0
        self.lock = threading.Lock()

    def get(self, entry_id: str) -> Entry | None:
        """The live entry, or None (absent, evicted, or expired by the cache's clock)."""
        entry, found = self.cache.get(entry_id)
        if not found:
            return None
        if entry.expires_at <= self.clock():
            self.discard([entry_id])
            return None
        return entry

    def put(self, entry: Entry) -> None:
        """Remember an entry; one larger than the whole byte budget stays out (and an older version of it goes)."""
        if entry.size > self.max_bytes:
            self.discard([entry.entry_id])
            return
        with self.lock:
            self.bytes += entry.size - self.sizes.pop(entry.entry_id, 0)
            self.sizes[entry.entry_id] = entry.size
            self.cache.set(entry.entry_id, entry)
            if self.bytes > self.max_bytes or len(self.sizes) > 2 * self.max_entries:
                self._fit()

    def _fit(self) -> None:
        for entry_id in [i for i in self.sizes if not self.cache.get(i)[1]]:
            self.bytes -= self.sizes.pop(entry_id)
        while self.bytes > self.max_bytes:
            entry_id = next(iter(self.sizes))
            self.cache.delete(entry_id)
            self.bytes -= self.sizes.pop(entry_id)

    def discard(self, entry_ids: list[str]) -> None:
        with self.lock:
            for entry_id in entry_ids:
                self.cache.delete(entry_id)
                self.bytes -= self.sizes.pop(entry_id, 0)

    def clear(self) -> None:
        with self.lock:
            self.cache.clear()
            self.sizes.clear()
            self.bytes = 0

    def __len__(self) -> int:
        return len(self.cache)
