"""Exact layer: an in-process layer bounded by entries and bytes (LRU, or W-TinyLFU in front of a shared store) over
the persistent store."""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

from cachetools import TLRUCache

from strata.cache.request.store import Entry, Store


class Memory(Protocol):
    """The in-process layer: LRU below, or tinylfu.TinyLFU. Thread-safe: the writer fills it, the event loop reads."""

    def get(self, entry_id: str) -> Entry | None: ...
    def put(self, entry: Entry) -> None: ...
    def discard(self, entry_ids: list[str]) -> None: ...
    def clear(self) -> None: ...
    def __len__(self) -> int: ...


class LRU:
    """cachetools' TLRU bounded by bytes (getsizeof) and by entries; an expired entry never comes back."""

    def __init__(self, max_entries: int, max_bytes: int, clock: Callable[[], float]):
        self.max_entries = max_entries
        self.cache: TLRUCache[str, Entry] = TLRUCache(
            maxsize=max_bytes, ttu=lambda _k, entry, _now: entry.expires_at, timer=clock,
            getsizeof=lambda entry: entry.size)
        self.lock = threading.Lock()

    def get(self, entry_id: str) -> Entry | None:
        with self.lock:
            return self.cache.get(entry_id)

    def put(self, entry: Entry) -> None:
        """Remember an entry; one larger than the whole byte budget stays out (and an older version of it goes)."""
        with self.lock:
            try:
                self.cache[entry.entry_id] = entry
            except ValueError:      # larger than the whole byte budget
                self.cache.pop(entry.entry_id, None)
                return
            while len(self.cache) > self.max_entries:
                self.cache.popitem()

    def discard(self, entry_ids: list[str]) -> None:
        with self.lock:
            for entry_id in entry_ids:
                self.cache.pop(entry_id, None)

    def clear(self) -> None:
        with self.lock:
            self.cache.clear()

    def __len__(self) -> int:
        with self.lock:
            return len(self.cache)


class ExactCache:
    """Exact-key lookups: memory first, then the store (a store hit is promoted); expired entries never serve."""

    def __init__(self, store: Store, memory: Memory, clock: Callable[[], float]):
        self.store = store
        self.memory = memory
        self.clock = clock
        self._forgets = 0           # bumped by every forget: a store read older than one is not promoted
        self._forget_lock = threading.Lock()

    def get(self, entry_id: str) -> Entry | None:
        """The live entry under entry_id, or None: memory, then the store (which may block: not on an event loop)."""
        entry = self.get_memory(entry_id)
        return entry if entry is not None else self.get_stored(entry_id)

    def get_memory(self, entry_id: str) -> Entry | None:
        """The entry if it is in memory (never blocks on the store)."""
        return self.memory.get(entry_id)

    def get_stored(self, entry_id: str) -> Entry | None:
        """The live entry from the store, promoted to memory unless entries were forgotten while it was read (an
        invalidation then may have deleted it after the read: promoting it would serve it until its TTL); reads the
        store, so call it off the event loop."""
        forgets = self._forgets
        entry = self.store.get(entry_id)
        if entry is None or entry.expires_at <= self.clock():
            return None
        with self._forget_lock:
            if forgets == self._forgets:
                self.remember(entry)
        return entry

    def remember(self, entry: Entry) -> None:
        """Put an entry in memory only (the store already has it); too big an entry just stays out."""
        self.memory.put(entry)

    def forget(self, entry_ids: list[str]) -> None:
        """Drop entries from memory (the caller deletes them from the store)."""
        with self._forget_lock:
            self._forgets += 1
            self.memory.discard(entry_ids)

    def clear(self) -> None:
        """Forget everything in memory (the store may have changed unseen)."""
        with self._forget_lock:
            self._forgets += 1
            self.memory.clear()

    def __len__(self) -> int:
        return len(self.memory)
