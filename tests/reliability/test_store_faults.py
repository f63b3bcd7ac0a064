"""Fault drills on the request cache's SQLite store: a damaged file at start is one line saying what to do (or, with
db_reset, an empty store beside the damaged one kept for inspection); a store that fails while serving turns
lookups into misses and writes into counted losses, says "degraded", and recovers by itself."""
import logging
import os
import sqlite3
import threading

import pytest
from helpers.request_cache import Clock, FakeSemantic, answer, chat, make, run

from strata.cache.request.store_faults import RECENT_S


def filled(tmp_path, n=40):
    """A real cache file (schema, indexes, WAL checkpointed on close) holding n answers."""
    cache = make(tmp_path, semantic=FakeSemantic())
    for i in range(n):
        run(answer(cache, chat(f"Explain sorting algorithm number {i}"), f"answer {i} " + "x" * 300))
    cache.close()
    return tmp_path / "cache.db"


def overwrite_page(db, name):
    """Garbage over the root page of table or index `name`, found via sqlite_master and PRAGMA page_size."""
    with sqlite3.connect(db) as raw:
        page_size = raw.execute("PRAGMA page_size").fetchone()[0]
        root = raw.execute("SELECT rootpage FROM sqlite_master WHERE name = ?", (name,)).fetchone()[0]
    with open(db, "r+b") as f:
        f.seek((root - 1) * page_size)
        f.write(bytes(range(256)) * (page_size // 256))


def damage(db, how):
    if how in ("entries_partition", "entries"):
        overwrite_page(db, how)
    elif how == "header":
        with open(db, "r+b") as f:
            f.write(b"not a database at all")
    elif how == "truncated":
        os.truncate(db, os.path.getsize(db) // 2)


@pytest.mark.parametrize("how", ["entries_partition", "entries", "header", "truncated"])
def test_a_damaged_file_stops_start_with_one_line_that_says_what_to_do(tmp_path, how):
    db = filled(tmp_path)
    damage(db, how)
    with pytest.raises(ValueError) as error:
        make(tmp_path)
    message = str(error.value)
    assert "\n" not in message and len(message) < 300, message
    assert f"{db} is corrupt" in message and "--cache-db-reset" in message
    assert error.value.__cause__ is None and error.value.__suppress_context__     # no chained traceback


def test_db_reset_moves_a_damaged_file_aside_and_starts_empty(tmp_path, caplog):
    db = filled(tmp_path)
    overwrite_page(db, "entries_partition")
    (tmp_path / "cache.db-wal").write_bytes(b"left over")
    with caplog.at_level(logging.WARNING):
        cache = make(tmp_path, db_reset=True)
    aside = {p.name for p in tmp_path.iterdir() if ".corrupt-" in p.name}
    (main,) = [name for name in aside if not name.endswith(("-wal", "-shm"))]
    assert main + "-wal" in aside and (tmp_path / (main + "-wal")).read_bytes() == b"left over"   # moved together
    assert any(main in r.getMessage() and str(db) in r.getMessage() for r in caplog.records)
    assert len(cache.store) == 0
    _, _, computed = run(answer(cache, chat("Explain sorting algorithm number 1"), "fresh"))
    assert computed == 1 and run(cache.lookup(chat("Explain sorting algorithm number 1"))).hit.text == "fresh"
    cache.close()


def test_db_reset_keeps_a_healthy_file(tmp_path):
    filled(tmp_path, n=3)
    cache = make(tmp_path, db_reset=True)
    assert len(cache.store) == 3 and not [p for p in tmp_path.iterdir() if ".corrupt-" in p.name]
    cache.close()


class Failing:
    """The store's connection, failing every statement while `failing` is set, as a disk that went bad would."""

    def __init__(self, db):
        self.db, self.failing = db, False

    def __getattr__(self, name):
        return getattr(self.db, name)

    def execute(self, *args):
        if self.failing:
            raise sqlite3.DatabaseError("database disk image is malformed")
        return self.db.execute(*args)

    def executemany(self, *args):
        return self.execute(*args) if self.failing else self.db.executemany(*args)

    def __enter__(self):
        return self.db.__enter__()

    def __exit__(self, *exc):
        return self.db.__exit__(*exc)


def test_a_store_failing_mid_run_serves_misses_says_degraded_and_recovers(tmp_path, caplog):
    clock = Clock()
    cache = make(tmp_path, clock=clock, memory_max_entries=1)
    run(answer(cache, chat("What is a B-tree?"), "A balanced search tree."))
    run(answer(cache, chat("What is a heap?"), "A tree with the heap property."))   # the B-tree is only stored now
    assert cache.health() == {"status": "ok", "reason": ""}
    cache.store.db = broken = Failing(cache.store.db)
    broken.failing = True

    async def during():
        outcomes = []
        for _ in range(5):
            lookup = await cache.lookup(chat("What is a B-tree?"))              # would be a hit from the store
            outcomes.append(lookup.layer)
            lookup.complete("A balanced search tree, again.")                  # its write fails too
            await cache.drain()
        return outcomes

    with caplog.at_level(logging.WARNING):
        outcomes = run(during())
    assert outcomes == ["miss"] * 5
    stats = cache.stats()
    assert stats["counters"]["store"]["error"] >= 10 and stats["counters"]["write"]["failed"] == 5
    health = cache.health()
    assert health["status"] == "degraded" and "store fault" in health["reason"] and "malformed" in health["reason"]
    lines = [r for r in caplog.records if "store fault" in r.getMessage()]
    assert 2 <= len(lines) <= 4 and all(r.exc_info is None for r in lines)      # one per operation, no traceback
    with pytest.raises(sqlite3.DatabaseError):
        cache.invalidate(tenant="default")                                    # an admin is told, not fooled

    broken.failing = False                                                    # the disk is back
    hit = run(cache.lookup(chat("What is a B-tree?")))
    assert (hit.layer, hit.hit.text) == ("exact", "A balanced search tree.")
    assert cache.health()["status"] == "degraded"                             # faults are still recent
    clock.t += RECENT_S
    assert cache.health() == {"status": "ok", "reason": ""}
    _, _, computed = run(answer(cache, chat("What is a trie?"), "A prefix tree."))
    assert computed == 1 and run(cache.lookup(chat("What is a trie?"))).layer == "exact"
    cache.close()


def test_a_full_disk_loses_writes_but_serves_what_is_stored(tmp_path):
    cache = make(tmp_path)
    run(answer(cache, chat("What is a B-tree?"), "A balanced search tree."))
    pages = cache.store.db.execute("PRAGMA page_count").fetchone()[0]
    cache.store.db.execute(f"PRAGMA max_page_count = {pages}")                 # SQLITE_FULL on the next growth
    for i in range(5):
        run(answer(cache, chat(f"Write a long essay number {i}"), "x" * 20_000))
    counters = cache.stats()["counters"]
    assert counters["write"]["failed"] == 5 and counters["store"]["error"] == 5
    assert "disk is full" in cache.health()["reason"]
    assert run(cache.lookup(chat("What is a B-tree?"))).hit.text == "A balanced search tree."
    cache.store.db.execute("PRAGMA max_page_count = 1073741823")
    run(answer(cache, chat("Write a long essay number 9"), "y" * 20_000))
    assert run(cache.lookup(chat("Write a long essay number 9"))).layer == "exact"
    cache.close()


def test_a_full_write_queue_is_degraded():
    cache = make(write_queue_size=1)
    gate = threading.Event()
    cache.writer.handle = lambda job: gate.wait(5)      # a stuck write-back: one write held, the next one queued

    async def go():
        for i in range(3):
            (await cache.lookup(chat(f"Write limerick {i}"))).complete(f"limerick {i}")

    run(go())
    health = cache.health()
    gate.set()
    assert health["status"] == "degraded" and "write queue full" in health["reason"]
    cache.close()
    assert cache.health()["status"] == "ok"


@pytest.mark.slow
def test_strata_serve_with_a_damaged_file_prints_one_line_and_exits_2(tmp_path):
    import subprocess
    import sys

    db = filled(tmp_path)
    overwrite_page(db, "entries_partition")
    res = subprocess.run([sys.executable, "-m", "strata.server.cli", "serve", "--port", "0", "--cache-db", str(db),
                          "--load-format", "dummy", "--model-config", "tiny-llama", "--cache-embedder", "none"],
                         capture_output=True, text=True, timeout=300)
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 2 and last.startswith("error: ") and str(db) in last and "--cache-db-reset" in last
    assert "Traceback" not in res.stderr
