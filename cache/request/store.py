"""Persistent entry store: a small protocol (a Redis store can follow) and the embedded SQLite (WAL) default."""
from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from strata.cache.request.request import AnswerMeta

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

    def put(self, entry: Entry) -> None: ...
    def get(self, entry_id: str) -> Entry | None: ...
    def delete(self, entry_ids: list[str]) -> int: ...
    def ids(self, *, tag: str | None = None, partition: str | None = None, model: str | None = None,
            tenant: str | None = None) -> list[str]: ...
    def touch(self, entry_id: str, hits: int, last_hit: float) -> None: ...
    def expired(self, now: float) -> list[str]: ...
    def entries(self) -> Iterator[Entry]: ...
    def __len__(self) -> int: ...
    def close(self) -> None: ...


_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    entry_id TEXT PRIMARY KEY, partition TEXT NOT NULL, tenant TEXT NOT NULL, model TEXT NOT NULL,
    text TEXT NOT NULL, answer TEXT NOT NULL, created_at REAL NOT NULL, expires_at REAL NOT NULL,
    ttl_class TEXT NOT NULL, tags TEXT NOT NULL, semantic INTEGER NOT NULL, hits INTEGER NOT NULL,
    last_hit REAL, embedding BLOB, meta TEXT);
CREATE INDEX IF NOT EXISTS entries_partition ON entries(partition);
CREATE INDEX IF NOT EXISTS entries_expires ON entries(expires_at);
CREATE TABLE IF NOT EXISTS entry_tags (tag TEXT NOT NULL, entry_id TEXT NOT NULL, PRIMARY KEY (tag, entry_id));
"""
_COLUMNS = ("entry_id, partition, tenant, model, text, answer, created_at, expires_at, ttl_class, tags, semantic, hits, "
            "last_hit, embedding, meta")
# Columns later versions added, as (name, declaration): an older file gains them on open, its rows read as defaults.
_ADDED_COLUMNS = (("meta", "TEXT"),)


class _Corrupt(Exception):
    """The store file is damaged (SQLITE_CORRUPT, SQLITE_NOTADB, or quick_check found a problem)."""


_CORRUPTION = ("SQLITE_CORRUPT", "SQLITE_NOTADB")


def _migrate(db: sqlite3.Connection) -> None:
    """Add the columns an older file lacks (its entries replay with meta None)."""
    have = {row[1] for row in db.execute("PRAGMA table_info(entries)")}
    for name, declaration in _ADDED_COLUMNS:
        if name not in have:
            db.execute(f"ALTER TABLE entries ADD COLUMN {name} {declaration}")


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


def _escape_like(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


class SQLiteStore:
    """stdlib sqlite3 in WAL mode: a restart keeps the cache, a kill -9 mid-write leaves a readable file.

    One connection guarded by a lock: the lookup path reads, the write-back thread writes.
    """

    def __init__(self, path: str | None = None, *, reset: bool = False):
        """Open (or create) the file and check it (PRAGMA quick_check: one pass over the file, no index cross-check).
        A damaged file is a one-line ValueError saying what to do, or with reset=True moved aside
        (<file>.corrupt-<time>, with its -wal and -shm) for an empty store. Other open failures: ValueError."""
        self.path = path or ":memory:"
        try:
            self.db = self._open()
        except _Corrupt as exc:
            if not reset:
                raise ValueError(f"request-cache store {self.path} is corrupt ({exc}); move it aside, or start with "
                                 f"--cache-db-reset (config db_reset) to have it moved aside and start empty") from None
            aside = _move_aside(self.path)
            log.warning("request-cache store %s is corrupt (%s): moved to %s, starting empty", self.path, exc, aside)
            self.db = self._open()
        self.lock = threading.Lock()

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

    def put(self, entry: Entry) -> None:
        """Insert or replace one entry and its tags in one transaction."""
        blob = None if entry.embedding is None else np.asarray(entry.embedding, np.float32).tobytes()
        row = (entry.entry_id, entry.partition, entry.tenant, entry.model, entry.text, entry.answer, entry.created_at,
               entry.expires_at, entry.ttl_class, json.dumps(list(entry.tags)), int(entry.semantic), entry.hits,
               entry.last_hit, blob, None if entry.meta is None else entry.meta.to_json())
        with self.lock, self.db:
            self.db.execute("BEGIN")
            self.db.execute(f"INSERT OR REPLACE INTO entries ({_COLUMNS}) VALUES ({','.join('?' * len(row))})", row)
            self.db.execute("DELETE FROM entry_tags WHERE entry_id = ?", (entry.entry_id,))
            self.db.executemany("INSERT INTO entry_tags VALUES (?, ?)", [(t, entry.entry_id) for t in entry.tags])

    def get(self, entry_id: str) -> Entry | None:
        """One entry by id, or None."""
        with self.lock:
            row = self.db.execute(f"SELECT {_COLUMNS} FROM entries WHERE entry_id = ?", (entry_id,)).fetchone()
        return _entry(row) if row else None

    def delete(self, entry_ids: list[str]) -> int:
        """Delete entries by id; returns how many existed."""
        if not entry_ids:
            return 0
        with self.lock, self.db:
            self.db.execute("BEGIN")
            gone = sum(self.db.execute("DELETE FROM entries WHERE entry_id = ?", (i,)).rowcount for i in entry_ids)
            self.db.executemany("DELETE FROM entry_tags WHERE entry_id = ?", [(i,) for i in entry_ids])
        return gone

    def ids(self, *, tag: str | None = None, partition: str | None = None, model: str | None = None,
            tenant: str | None = None) -> list[str]:
        """Ids matching every given filter; partition matches itself and every partition under it ("t|m" covers "t|m|...")."""
        where, args = [], []
        if tag is not None:
            where.append("entry_id IN (SELECT entry_id FROM entry_tags WHERE tag = ?)")
            args.append(tag)
        if partition is not None:
            where.append("(partition = ? OR partition LIKE ? ESCAPE '\\')")
            args += [partition, _escape_like(partition) + "|%"]
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
            rows = self.db.execute(f"SELECT {_COLUMNS} FROM entries").fetchall()
        return (_entry(r) for r in rows)

    def __len__(self) -> int:
        with self.lock:
            return self.db.execute("SELECT COUNT(*) FROM entries").fetchone()[0]

    def close(self) -> None:
        """Close the connection (WAL is checkpointed by sqlite on the last close)."""
        with self.lock:
            self.db.close()


def _entry(row: tuple) -> Entry:
    *head, tags, semantic, hits, last_hit, blob, meta = row
    embedding = None if blob is None else np.frombuffer(blob, dtype=np.float32).copy()
    return Entry(*head, tags=tuple(json.loads(tags)), semantic=bool(semantic), hits=hits, last_hit=last_hit,
                 embedding=embedding, meta=None if meta is None else AnswerMeta.from_json(meta))
