"""Persistent entry store: a small protocol (redis_store.py follows it too) and the embedded SQLite (WAL) default."""
from __future__ import annotations

import fcntl
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import xxhash

from strata.cache.request.request import AnswerMeta
from strata.cache.request.store_quota import StoreQuota

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Entry:
    """One cached answer: keyed by the exact key, scoped by partition, templated when personal."""

    entry_id: str
    partition: str              # tenant|model|system|context|sampling
    tenant: str
    model: str
    text: str                   # key text (templated when personal); the semantic layer indexes it
    answer: str                 # may hold placeholders, filled per request
    created_at: float
    expires_at: float
    ttl_class: str = "default"
    tags: tuple[str, ...] = ()
    semantic: bool = True       # indexed by the semantic layer
    hits: int = 0
    last_hit: float | None = None
    embedding: np.ndarray | None = field(default=None, repr=False)
    meta: AnswerMeta | None = None   # finish reason and token count of the answer, replayed with each hit

    @property
    def size(self) -> int:
        """Approximate bytes held in memory, for the byte bound of the in-process layer."""
        return 250 + 2 * (len(self.text) + len(self.answer) + len(self.partition)) + \
            (self.embedding.nbytes if self.embedding is not None else 0)


class Store(Protocol):
    """What the request cache needs from persistence; SQLiteStore is the embedded default."""

    def put(self, entry: Entry) -> list[tuple[str, str]]: ...   # (id, reason) evicted to make room
    def get(self, entry_id: str) -> Entry | None: ...
    def delete(self, entry_ids: list[str]) -> int: ...
    def ids(self, *, tag: str | None = None, partition: str | None = None, model: str | None = None,
            tenant: str | None = None) -> list[str]: ...
    def touch(self, entry_id: str, hits: int, last_hit: float) -> None: ...
    def expired(self, now: float) -> list[str]: ...
    def entries(self) -> Iterator[Entry]: ...
    def usage(self) -> dict: ...
    # told the ids of entries a read found changed under their checksum (and deleted), so the cache in front forgets
    # them too: its semantic index would otherwise keep naming an entry that no longer exists
    on_damaged: Callable[[list[str]], None] | None
    def __len__(self) -> int: ...
    def close(self) -> None: ...


_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    entry_id TEXT PRIMARY KEY, partition TEXT NOT NULL, tenant TEXT NOT NULL, model TEXT NOT NULL,
    text TEXT NOT NULL, answer TEXT NOT NULL, created_at REAL NOT NULL, expires_at REAL NOT NULL,
    ttl_class TEXT NOT NULL, tags TEXT NOT NULL, semantic INTEGER NOT NULL, hits INTEGER NOT NULL,
    last_hit REAL, embedding BLOB, meta TEXT, size INTEGER NOT NULL DEFAULT 0, checksum INTEGER);
CREATE INDEX IF NOT EXISTS entries_partition ON entries(partition);
CREATE INDEX IF NOT EXISTS entries_expires ON entries(expires_at);
CREATE INDEX IF NOT EXISTS entries_lru ON entries(COALESCE(last_hit, created_at));
CREATE INDEX IF NOT EXISTS entries_tenant_lru ON entries(tenant, COALESCE(last_hit, created_at));
CREATE TABLE IF NOT EXISTS entry_tags (tag TEXT NOT NULL, entry_id TEXT NOT NULL, PRIMARY KEY (tag, entry_id));
"""
_COLUMNS = ("entry_id, partition, tenant, model, text, answer, created_at, expires_at, ttl_class, tags, semantic, hits, "
            "last_hit, embedding, meta")
# Columns later versions added, as (name, declaration): an older file gains them on open, its rows read as defaults.
_ADDED_COLUMNS = (("meta", "TEXT"), ("size", "INTEGER NOT NULL DEFAULT 0"), ("checksum", "INTEGER"))
# What an entry's checksum covers: every column but the hit counters, which touch() rewrites on each hit. A later
# version that adds a column leaves it out of the checksum, or an older one reading the file drops every row.
_CHECKED = tuple(i for i, name in enumerate(_COLUMNS.split(", ")) if name not in ("hits", "last_hit"))
_ROW_OVERHEAD = 100     # bytes per entry beyond its texts and blobs: record header, numbers, key and index entries


class _Corrupt(Exception):
    """The store file is damaged (SQLITE_CORRUPT, SQLITE_NOTADB, or quick_check found a problem)."""


_CORRUPTION = ("SQLITE_CORRUPT", "SQLITE_NOTADB")


def _migrate(db: sqlite3.Connection) -> None:
    """Add the columns an older file lacks: its entries replay with meta None and get their sizes computed."""
    have = {row[1] for row in db.execute("PRAGMA table_info(entries)")}
    with db:
        db.execute("BEGIN")
        for name, declaration in _ADDED_COLUMNS:
            if name not in have:
                db.execute(f"ALTER TABLE entries ADD COLUMN {name} {declaration}")
        if "size" not in have or "checksum" not in have:
            rows = db.execute(f"SELECT {_COLUMNS} FROM entries").fetchall()
            db.executemany("UPDATE entries SET size = ?, checksum = ? WHERE entry_id = ?",
                           [(_row_size(r), _checksum(r), r[0]) for r in rows])


def _row(entry: Entry) -> tuple:
    """The stored columns (_COLUMNS order) of an entry."""
    blob = None if entry.embedding is None else np.asarray(entry.embedding, np.float32).tobytes()
    return (entry.entry_id, entry.partition, entry.tenant, entry.model, entry.text, entry.answer, entry.created_at,
            entry.expires_at, entry.ttl_class, json.dumps(list(entry.tags)), int(entry.semantic), entry.hits,
            entry.last_hit, blob, None if entry.meta is None else entry.meta.to_json())


def _checksum(row: tuple) -> int:
    """xxh64 of a row's content (_CHECKED columns) as a signed 64-bit SQLite integer. SQLite checks no page's content:
    a flipped bit in an answer would otherwise be served as the answer."""
    digest = xxhash.xxh64()
    for i in _CHECKED:
        value = row[i]
        if isinstance(value, int | float):
            value = repr(float(value))      # 5 is written, 5.0 read back
        data = b"" if value is None else value if isinstance(value, bytes) else value.encode()
        digest.update((-1 if value is None else len(data)).to_bytes(8, "little", signed=True))
        digest.update(data)
    unsigned = digest.intdigest()
    return unsigned - (1 << 64) if unsigned >= 1 << 63 else unsigned


def report_damaged(damaged: list[str], on_damaged: Callable[[list[str]], None] | None) -> None:
    """Log entries a store dropped because their content no longer matched its checksum, and tell its listener."""
    if not damaged:
        return
    log.error("request-cache store: %d entr%s failed %s checksum and %s dropped: %s", len(damaged),
              "y" if len(damaged) == 1 else "ies", "its" if len(damaged) == 1 else "their",
              "was" if len(damaged) == 1 else "were", ", ".join(damaged[:5]))
    if on_damaged is not None:
        on_damaged(damaged)


def _row_size(row: tuple) -> int:
    """Bytes an entry counts against the bounds: its texts (UTF-8) and blobs, plus a fixed overhead."""
    return _ROW_OVERHEAD + sum(len(v.encode()) if isinstance(v, str) else len(v)
                               for v in row if isinstance(v, (str, bytes)))


def stored_size(entry: Entry) -> int:
    """Bytes an entry counts against a store's bounds (the same for every store)."""
    return _row_size(_row(entry))


def _move_aside(path: str) -> str:
    """Rename a damaged file and its WAL companions to <file>.corrupt-<UTC time>[.n]; returns the new name."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    aside, n = f"{path}.corrupt-{stamp}", 0
    while os.path.exists(aside):
        n += 1
        aside = f"{path}.corrupt-{stamp}.{n}"
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(path + suffix):
            os.replace(path + suffix, aside + suffix)
    return aside


class SQLiteStore:
    """stdlib sqlite3 in WAL mode: a restart keeps the cache, a kill -9 mid-write leaves a readable file.

    One connection guarded by a lock: the lookup path reads, the write-back thread writes.
    """

    def __init__(self, path: str | None = None, *, reset: bool = False, max_bytes: int = 2**30,
                 tenant_max_share: float = 1.0):
        """Open (or create) the file and check it (PRAGMA quick_check: one pass over the file, no index cross-check).
        A damaged file is a one-line ValueError saying what to do, or with reset=True moved aside
        (<file>.corrupt-<time>, with its -wal and -shm) for an empty store. Other open failures: ValueError.
        max_bytes bounds the entries' bytes, tenant_max_share the fraction one tenant may hold (see StoreQuota)."""
        self.quota = StoreQuota(max_bytes, tenant_max_share)
        self.on_damaged: Callable[[list[str]], None] | None = None     # see Store
        self.path = path or ":memory:"
        self.owner = None if self.path == ":memory:" else _own(self.path)
        try:
            try:
                self.db = self._open()
            except _Corrupt as exc:
                if not reset:
                    raise ValueError(f"request-cache store {self.path} is corrupt ({exc}); move it aside, or start "
                                     f"with --cache-db-reset (config db_reset) to have it moved aside and start "
                                     f"empty") from None
                aside = _move_aside(self.path)
                log.warning("request-cache store %s is corrupt (%s): moved to %s, starting empty", self.path, exc,
                            aside)
                self.db = self._open()
            self.lock = threading.Lock()
            self.quota.load(self.db)
            self._fit()
        except BaseException:
            if self.owner is not None:
                self.owner.close()
            raise

    def _open(self) -> sqlite3.Connection:
        try:
            if self.path != ":memory:":
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        except (OSError, sqlite3.Error) as exc:
            raise ValueError(f"cannot open request-cache store {self.path}: {exc}") from None
        try:
            db.execute("PRAGMA journal_mode=WAL")
            problem = db.execute("PRAGMA quick_check(1)").fetchone()[0]
            if problem != "ok":
                raise _Corrupt(problem)
            db.execute("PRAGMA synchronous=NORMAL")
            db.executescript(_SCHEMA)
            _migrate(db)
            return db
        except (_Corrupt, sqlite3.Error) as exc:
            db.close()
            if isinstance(exc, _Corrupt) or getattr(exc, "sqlite_errorname", "").startswith(_CORRUPTION):
                raise _Corrupt(" ".join(str(exc).replace("*** in database main ***", "").split())) from None
            raise ValueError(f"cannot open request-cache store {self.path}: {exc}") from None

    def put(self, entry: Entry) -> list[tuple[str, str]]:
        """Insert or replace one entry and its tags in one transaction, first evicting what the byte bounds require
        (entry.created_at is "now" for what has expired). Returns the evicted (id, reason); EntryTooLarge (nothing
        written or evicted) when the entry alone is over its tenant's share."""
        row = _row(entry)
        size = _row_size(row)
        self.quota.check(size)
        with self.lock:
            with self.db:
                self.db.execute("BEGIN")
                replaced = self.db.execute("SELECT tenant, size FROM entries WHERE entry_id = ?",
                                           (entry.entry_id,)).fetchone()
                victims = self.quota.victims(self.db, entry.tenant, entry.entry_id, size, replaced, entry.created_at)
                gone = self._delete_rows([entry.entry_id, *victims])
                self.db.execute(f"INSERT INTO entries ({_COLUMNS}, size, checksum) "
                                f"VALUES ({','.join('?' * (len(row) + 2))})", (*row, size, _checksum(row)))
                self.db.executemany("INSERT INTO entry_tags VALUES (?, ?)", [(t, entry.entry_id) for t in entry.tags])
            self._account(gone)
            self.quota.account(entry.tenant, size, 1)
        return [(victim, reason) for victim, (_, _, reason) in victims.items()]

    def get(self, entry_id: str) -> Entry | None:
        """One entry by id, or None (also for one whose content no longer matches its checksum: dropped)."""
        with self.lock:
            row = self.db.execute(f"SELECT {_COLUMNS}, checksum FROM entries WHERE entry_id = ?",
                                  (entry_id,)).fetchone()
            rows, damaged = self._intact([row] if row else [])
        report_damaged(damaged, self.on_damaged)     # outside the lock: the listener takes the cache's
        return _entry(rows[0]) if rows else None

    def _intact(self, rows: list[tuple]) -> tuple[list[tuple], list[str]]:
        """(the rows (columns, then checksum) whose content matches their checksum, without it; the ids of the others,
        now deleted). Called with the lock held, from the read that fetched the rows: deleted in the same hold, so a
        put of the same id that lands after the read is never the row deleted."""
        damaged = [row[0] for row in rows if _checksum(row[:-1]) != row[-1]]
        if damaged:
            with self.db:
                self.db.execute("BEGIN")
                gone = self._delete_rows(damaged)
            self._account(gone)
        return [row[:-1] for row in rows if row[0] not in damaged], damaged

    def delete(self, entry_ids: list[str]) -> int:
        """Delete entries by id; returns how many existed."""
        if not entry_ids:
            return 0
        with self.lock:
            with self.db:
                self.db.execute("BEGIN")
                gone = self._delete_rows(entry_ids)
            self._account(gone)
        return len(gone)

    def _delete_rows(self, entry_ids: list[str]) -> list[tuple[str, int]]:
        """Delete rows and their tags in the open transaction; (tenant, size) of each row that existed."""
        gone = [row for entry_id in entry_ids for row in self.db.execute(
            "DELETE FROM entries WHERE entry_id = ? RETURNING tenant, size", (entry_id,)).fetchall()]
        self.db.executemany("DELETE FROM entry_tags WHERE entry_id = ?", [(i,) for i in entry_ids])
        return gone

    def _account(self, gone: list[tuple[str, int]]) -> None:
        for tenant, size in gone:
            self.quota.account(tenant, -size, -1)

    def _fit(self) -> None:
        """Bring a file that holds more than the bounds allow (they were lowered) within them, least recently used
        first; expired entries go in the cache's own purge right after."""
        usage = self.quota.usage()
        over = [t for t, held in usage["tenants"].items() if held > self.quota.tenant_max_bytes]
        evicted = 0
        for tenant in [*over, ""]:          # "" holds nothing: only the global bound is checked for it
            with self.db:
                self.db.execute("BEGIN")
                gone = self._delete_rows(list(self.quota.victims(self.db, tenant, "", 0, None, None)))
            self._account(gone)
            evicted += len(gone)
        if evicted:
            log.warning("request-cache store %s: %d entries evicted to fit max_bytes %d (per tenant %d)", self.path,
                        evicted, self.quota.max_bytes, self.quota.tenant_max_bytes)

    def ids(self, *, tag: str | None = None, partition: str | None = None, model: str | None = None,
            tenant: str | None = None) -> list[str]:
        """Ids matching every given filter; partition matches itself and every partition under it ("t|m" covers "t|m|...")."""
        where, args = [], []
        if tag is not None:
            where.append("entry_id IN (SELECT entry_id FROM entry_tags WHERE tag = ?)")
            args.append(tag)
        if partition is not None:
            # substr, not LIKE: LIKE ignores ASCII case, and tenants "acme" and "ACME" are two
            where.append("(partition = ? OR substr(partition, 1, ?) = ?)")
            args += [partition, len(partition) + 1, partition + "|"]
        if model is not None:
            where.append("model = ?")
            args.append(model)
        if tenant is not None:
            where.append("tenant = ?")
            args.append(tenant)
        sql = "SELECT entry_id FROM entries" + (" WHERE " + " AND ".join(where) if where else "")
        with self.lock:
            return [r[0] for r in self.db.execute(sql, args)]

    def touch(self, entry_id: str, hits: int, last_hit: float) -> None:
        """Persist hit count and last-hit time."""
        with self.lock:
            self.db.execute("UPDATE entries SET hits = ?, last_hit = ? WHERE entry_id = ?", (hits, last_hit, entry_id))

    def expired(self, now: float) -> list[str]:
        """Ids whose TTL has passed (the caller deletes them and drops them from the indexes)."""
        with self.lock:
            return [r[0] for r in self.db.execute("SELECT entry_id FROM entries WHERE expires_at <= ?", (now,))]

    def entries(self) -> Iterator[Entry]:
        """Every stored entry (to rebuild the semantic index on start); read in one snapshot."""
        with self.lock:
            rows, damaged = self._intact(self.db.execute(f"SELECT {_COLUMNS}, checksum FROM entries").fetchall())
        report_damaged(damaged, self.on_damaged)     # outside the lock: the listener takes the cache's
        return (_entry(r) for r in rows)

    def usage(self) -> dict:
        """Bytes held in all and per tenant, entries, bounds: running totals, no I/O (safe on the event loop)."""
        return self.quota.usage()

    def __len__(self) -> int:
        return self.quota.usage()["entries"]

    def close(self) -> None:
        """Close the connection (WAL is checkpointed by sqlite on the last close) and give the file up."""
        with self.lock:
            self.db.close()
        if self.owner is not None:
            self.owner.close()          # closing the descriptor releases the lock


def _own(path: str):
    """Hold <path>.lock for this store's life: two servers on one file each kept their own in-process layer and byte
    totals, so an invalidation on one left the other serving the deleted answers. The kernel releases the lock when
    the process dies, kill -9 included."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        # the file's real path: a symlink to another server's database named another lock file, and both served it
        owner = open(f"{os.path.realpath(path)}.lock", "a+")          # noqa: SIM115 - held open until close()
    except OSError as exc:
        raise ValueError(f"cannot open request-cache store {path}: {exc}") from None
    try:
        fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner.seek(0)
        holder = owner.read().strip() or "another process"
        owner.close()
        raise ValueError(f"request-cache store {path} is in use by {holder}: give each server its own --cache-db, "
                         f"or share answers between servers with --cache-redis") from None
    owner.seek(0)
    owner.truncate()
    owner.write(f"pid {os.getpid()}")
    owner.flush()
    return owner


def _entry(row: tuple) -> Entry:
    *head, tags, semantic, hits, last_hit, blob, meta = row
    embedding = None if blob is None else np.frombuffer(blob, dtype=np.float32).copy()
    return Entry(*head, tags=tuple(json.loads(tags)), semantic=bool(semantic), hits=hits, last_hit=last_hit,
                 embedding=embedding, meta=None if meta is None else AnswerMeta.from_json(meta))
