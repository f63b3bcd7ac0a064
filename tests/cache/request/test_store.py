"""SQLite (WAL) store: round trip, filters, restart, and a readable file after kill -9 mid-write."""
import os
import signal
import sqlite3
import subprocess
import sys
import time

import numpy as np
import pytest

from strata.cache.request.store import Entry, SQLiteStore


def entry(i, partition="t|m@1|s|c|p", tags=("faq",), **kw):
    return Entry(f"id{i}", partition, partition.split("|")[0], partition.split("|")[1], f"question {i}",
                 f"answer {i}", 100.0, 200.0, tags=tags, **kw)


def test_round_trip_and_filters(tmp_path):
    store = SQLiteStore(str(tmp_path / "c.db"))
    emb = np.arange(4, dtype=np.float32)
    store.put(entry(1, embedding=emb))
    store.put(entry(2, partition="t|m@2|s|c|p", tags=("faq", "pricing")))
    store.put(entry(3, partition="u|m@1|s|c|p", tags=()))
    got = store.get("id1")
    assert got.answer == "answer 1" and got.tags == ("faq",) and np.array_equal(got.embedding, emb)
    assert store.get("nope") is None
    assert sorted(store.ids(tag="faq")) == ["id1", "id2"]
    assert store.ids(tag="pricing") == ["id2"]
    assert store.ids(partition="t|m@1") == ["id1"]            # prefix on '|' boundaries
    assert store.ids(partition="t|m@") == []                   # not a raw string prefix
    store.put(entry(4, partition="T|m@1|s|c|p"))
    store.put(entry(5, partition="t_x|m@1|s|c|p"))
    assert sorted(store.ids(partition="t")) == ["id1", "id2"]
    assert store.ids(partition="T") == ["id4"]                 # tenants "t" and "T" are two (LIKE ignored case)
    assert store.ids(partition="t_x") == ["id5"] and store.ids(partition="t%") == []
    store.delete(["id4", "id5"])
    assert sorted(store.ids(model="m@1")) == ["id1", "id3"]
    assert store.ids(tenant="u") == ["id3"]
    store.put(entry(1, tags=("other",)))                      # replace drops old tags
    assert store.ids(tag="faq") == ["id2"]
    store.touch("id2", 5, 150.0)
    assert (store.get("id2").hits, store.get("id2").last_hit) == (5, 150.0)
    assert store.expired(199.0) == [] and len(store.expired(200.0)) == 3
    assert store.delete(["id1", "nope"]) == 1 and len(store) == 2
    store.close()
    reopened = SQLiteStore(str(tmp_path / "c.db"))
    assert sorted(e.entry_id for e in reopened.entries()) == ["id2", "id3"]
    reopened.close()


def test_an_entry_whose_content_changed_under_its_checksum_is_dropped_not_served(tmp_path, caplog):
    """SQLite checks no page's content: a changed byte in a stored answer (a disk or an editor) is caught by the entry's
    checksum, logged, deleted, and read as a miss; hit counters may change freely (touch)."""
    path = str(tmp_path / "c.db")
    store = SQLiteStore(path)
    told = []
    store.on_damaged = told.extend          # the request cache forgets them (test_request_cache)
    for i in (1, 2, 3):
        store.put(entry(i, embedding=np.arange(4, dtype=np.float32)))
    store.touch("id1", 7, 150.0)
    with sqlite3.connect(path) as db:
        db.execute("UPDATE entries SET answer = 'answer 9' WHERE entry_id = 'id2'")
        db.execute("UPDATE entries SET embedding = ? WHERE entry_id = 'id3'", (np.ones(4, np.float32).tobytes(),))
    assert store.get("id1").hits == 7
    assert store.get("id2") is None and "failed its checksum" in caplog.text and "id2" in caplog.text
    assert [e.entry_id for e in store.entries()] == ["id1"] and len(store) == 1
    assert store.ids() == ["id1"] and told == ["id2", "id3"]
    store.close()


def test_a_file_from_before_checksums_gains_them_on_open(tmp_path):
    path = str(tmp_path / "old.db")
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE entries (entry_id TEXT PRIMARY KEY, partition TEXT NOT NULL, tenant TEXT NOT NULL, "
                   "model TEXT NOT NULL, text TEXT NOT NULL, answer TEXT NOT NULL, created_at REAL NOT NULL, "
                   "expires_at REAL NOT NULL, ttl_class TEXT NOT NULL, tags TEXT NOT NULL, semantic INTEGER NOT NULL, "
                   "hits INTEGER NOT NULL, last_hit REAL, embedding BLOB, meta TEXT, size INTEGER NOT NULL DEFAULT 0)")
        db.execute("INSERT INTO entries VALUES ('old', 't|m@1|s|c|p', 't', 'm@1', 'q', 'a', 100, 200, 'default', '[]', 1, "
                   "0, NULL, NULL, NULL, 0)")
    store = SQLiteStore(path)
    got = store.get("old")
    assert got is not None and got.answer == "a" and got.created_at == 100.0
    store.close()


def test_missing_folders_are_created_and_bad_files_are_a_value_error(tmp_path):
    SQLiteStore(str(tmp_path / "a" / "b" / "c.db")).close()
    assert (tmp_path / "a" / "b" / "c.db").exists()
    (tmp_path / "junk.db").write_bytes(b"this is not a database" * 100)     # damaged: says so, and what to do
    with pytest.raises(ValueError, match=r"junk.db is corrupt \(file is not a database\); move it aside.*--cache-db-reset"):
        SQLiteStore(str(tmp_path / "junk.db"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="cannot open"):
        SQLiteStore(str(tmp_path / "file" / "c.db"))


_WRITER = """
import asyncio, os, sys
from strata.cache.request.request_cache import RequestCache, RequestCacheConfig, CacheRequest

async def main():
    cache = RequestCache(RequestCacheConfig(db=sys.argv[1]))
    i = 0
    while True:
        req = CacheRequest("t", "m", [{"role": "user", "content": f"Write poem number {i}"}], {"temperature": 0})
        await cache.get_or_compute(req, lambda i=i: asyncio.sleep(0, result=f"poem {i} " + "x" * 2000))
        if i % 20 == 19:
            await cache.drain()
            with open(sys.argv[2] + ".tmp", "w") as f:
                f.write(str(i + 1))
            os.replace(sys.argv[2] + ".tmp", sys.argv[2])
        i += 1

asyncio.run(main())
"""


def test_kill_9_during_writes_leaves_a_readable_store(tmp_path):
    db, progress = str(tmp_path / "killed.db"), tmp_path / "progress"
    child = subprocess.Popen([sys.executable, "-c", _WRITER, db, str(progress)])
    try:
        committed = 0
        deadline = time.monotonic() + 30
        while committed < 100 and time.monotonic() < deadline and child.poll() is None:
            time.sleep(0.02)
            committed = int(progress.read_text()) if progress.exists() else 0
        assert committed >= 100, "writer made no progress"
        os.kill(child.pid, signal.SIGKILL)      # while it keeps writing
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL
    with sqlite3.connect(db) as raw:
        assert raw.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    store = SQLiteStore(db)
    rows = list(store.entries())
    assert len(rows) >= committed                      # everything drained before the kill survived
    assert all(e.answer.startswith("poem ") for e in rows)
    store.close()


def test_a_second_store_on_one_file_is_refused_until_the_first_closes(tmp_path):
    """Two servers on one file each kept their own in-process layer and byte totals: an invalidation on one left the
    other serving the deleted answers. The second now stops with a clear error; a closed or killed owner frees it."""
    path = str(tmp_path / "cache.db")
    first = SQLiteStore(path)
    with pytest.raises(ValueError, match=rf"cache.db is in use by pid {os.getpid()}: .*--cache-redis"):
        SQLiteStore(path)
    (tmp_path / "link.db").symlink_to(path)                       # the same file by another name
    with pytest.raises(ValueError, match=rf"link.db is in use by pid {os.getpid()}"):
        SQLiteStore(str(tmp_path / "link.db"))
    first.close()
    SQLiteStore(path).close()
    (tmp_path / "junk.db").write_bytes(b"this is not a database" * 100)
    with pytest.raises(ValueError, match="corrupt"):
        SQLiteStore(str(tmp_path / "junk.db"))
    SQLiteStore(str(tmp_path / "junk.db"), reset=True).close()        # the failed open gave the file up
