"""Byte bounds of the SQLite store: a global budget and a per-tenant share, kept with running totals (one scan when
the file opens, none per write) and enforced inside the writing transaction by eviction."""
from __future__ import annotations

import sqlite3
import threading

# Both passes walk an index (entries_expires: only the few expired rows the minutely purge has not taken yet;
# entries_lru / entries_tenant_lru: in order of last use) and stop once enough is freed: no scan per write.
_LRU = "COALESCE(last_hit, created_at)"      # last use: the last hit, else the write


class EntryTooLarge(ValueError):
    """One entry larger than a tenant may hold: it is not written (nothing is evicted for it)."""


class StoreQuota:
    """Who holds how many bytes, and what to evict when a write would pass a bound: expired entries first, then the
    least recently used, within the writing tenant when it would pass its share, else across all tenants.
    So a tenant at its share only ever evicts its own entries."""

    def __init__(self, max_bytes: int, tenant_max_share: float = 1.0):
        if max_bytes < 1 or not 0.0 < tenant_max_share <= 1.0:
            raise ValueError(f"need max_bytes >= 1 and 0 < tenant_max_share <= 1, got {max_bytes}, {tenant_max_share}")
        self.max_bytes = max_bytes
        self.tenant_max_bytes = max(1, int(max_bytes * tenant_max_share))
        self.tenants: dict[str, int] = {}       # bytes per tenant
        self.total = 0
        self.count = 0
        self.lock = threading.Lock()            # totals only, held briefly: stats() reads them on the event loop

    def load(self, db: sqlite3.Connection) -> None:
        """Totals from the file (once, when it opens)."""
        rows = db.execute("SELECT tenant, SUM(size), COUNT(*) FROM entries GROUP BY tenant").fetchall()
        with self.lock:
            self.tenants = {tenant: size for tenant, size, _ in rows}
            self.total = sum(self.tenants.values())
            self.count = sum(n for *_, n in rows)

    def set_totals(self, tenants: dict[str, int], count: int) -> None:
        """Totals as a shared store reported them (Redis keeps the truth; this is the loop-safe mirror)."""
        with self.lock:
            self.tenants, self.total, self.count = dict(tenants), sum(tenants.values()), count

    def account(self, tenant: str, size: int, count: int) -> None:
        """Apply a committed change: size bytes and count entries added (negative: removed) for tenant."""
        with self.lock:
            held = self.tenants.get(tenant, 0) + size
            if held > 0:
                self.tenants[tenant] = held
            else:
                self.tenants.pop(tenant, None)
            self.total += size
            self.count += count

    def check(self, size: int) -> None:
        """EntryTooLarge when one entry of this size could never fit its tenant's share."""
        if size > self.tenant_max_bytes:
            raise EntryTooLarge(f"entry of {size} bytes exceeds the store's per-tenant bound of {self.tenant_max_bytes}")

    def victims(self, db: sqlite3.Connection, tenant: str, entry_id: str, size: int, replaced: tuple[str, int] | None,
                now: float | None) -> dict[str, tuple[str, int, str]]:
        """Entries to delete, in the open transaction, so that entry_id (size bytes, replacing `replaced` = its old
        (tenant, size) if any) fits: {id: (tenant, size, reason)}, reason "expired" | "tenant_lru" | "lru".
        now None skips the expired pass (the caller purges expired entries itself)."""
        old_tenant, old_size = replaced or ("", 0)
        with self.lock:
            tenant_after = self.tenants.get(tenant, 0) + size - (old_size if old_tenant == tenant else 0)
            total_after = self.total + size - old_size
        chosen: dict[str, tuple[str, int, str]] = {}
        if self.tenant_max_bytes < self.max_bytes and tenant_after > self.tenant_max_bytes:
            total_after -= self._choose(db, chosen, tenant_after - self.tenant_max_bytes, entry_id, tenant, now)
        if total_after > self.max_bytes:
            self._choose(db, chosen, total_after - self.max_bytes, entry_id, None, now)
        return chosen

    def _choose(self, db: sqlite3.Connection, chosen: dict, need: int, keep: str, tenant: str | None,
                now: float | None) -> int:
        """Add victims to `chosen` until `need` bytes are freed; returns the bytes freed."""
        scope, args = ("tenant = ? AND ", [tenant]) if tenant is not None else ("", [])
        passes = [("tenant_lru" if tenant is not None else "lru",
                   f"SELECT entry_id, tenant, size FROM entries WHERE {scope}1 ORDER BY {_LRU}", args)]
        if now is not None:
            passes.insert(0, ("expired", "SELECT entry_id, tenant, size FROM entries INDEXED BY entries_expires "
                                         f"WHERE {scope}expires_at <= ? ORDER BY expires_at", [*args, now]))
        freed = 0
        for reason, sql, params in passes:
            if freed >= need:
                break
            cursor = db.execute(sql, params)
            try:
                for victim, owner, victim_size in cursor:
                    if freed >= need:
                        return freed
                    if victim != keep and victim not in chosen:
                        chosen[victim] = (owner, victim_size, reason)
                        freed += victim_size
            finally:
                cursor.close()
        return freed

    def usage(self) -> dict:
        """Plain data for stats() and /metrics: bytes held in all and per tenant, entries, bounds."""
        with self.lock:
            return {"bytes": self.total, "entries": self.count, "max_bytes": self.max_bytes,
                    "tenant_max_bytes": self.tenant_max_bytes, "tenants": dict(self.tenants)}
