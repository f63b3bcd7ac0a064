"""Exact layer: an in-process LRU (cachetools), bounded by entries and bytes, over the persistent store."""
from __future__ import annotations

import threading
from collections.abc import Callable

from cachetools import TLRUCache

from strata.cache.request.store import Entry, Store


class ExactCache:
    """Exact-key lookups: memory first, then the store (a store hit is promoted); expired entries never serve.

    A lock guards the LRU because the write-back thread fills it while the event loop reads it.
    """

    def __init__(self, store: Store, max_entries: int, max_bytes: int, clock: Callable[[], float]):
        self.store = store
        self.max_entries = max_entries
        self.clock = clock
        self.memory: TLRUCache[str, Entry] = TLRUCache(
            maxsize=max_bytes, ttu=lambda _k, entry, _now: entry.expires_at, timer=clock,
            getsizeof=lambda entry: entry.size)
        self.lock = threading.Lock()

    def get(self, entry_id: str) -> Entry | None:
        """The live entry under entry_id, or None: memory, then the store (which may block: not on an event loop)."""
        entry = self.get_memory(entry_id)
        return entry if entry is not None else self.get_stored(entry_id)

    def get_memory(self, entry_id: str) -> Entry | None:
        """The entry if it is in memory (never blocks on the store)."""
        with self.lock:
            return self.memory.get(entry_id)

    def get_stored(self, entry_id: str) -> Entry | None:
        """The live entry from the store, promoted to memory; reads the store, so call it off the event loop."""
        entry = self.store.get(entry_id)
        if entry is None or entry.expires_at <= self.clock():
            return None
        self.remember(entry)
        return entry

    def remember(self, entry: Entry) -> None:
        """Put an entry in memory only (the store already has it); too big an entry just stays out."""
        with self.lock:
            try:
                self.memory[entry.entry_id] = entry
            except ValueError:      # larger than the whole byte budget
                return
            while len(self.memory) > self.max_entries:
                self.memory.popitem()

    def forget(self, entry_ids: list[str]) -> None:
        """Drop entries from memory (the caller deletes them from the store)."""
        with self.lock:
            for entry_id in entry_ids:
                self.memory.pop(entry_id, None)

    def __len__(self) -> int:
        with self.lock:
            return len(self.memory)
