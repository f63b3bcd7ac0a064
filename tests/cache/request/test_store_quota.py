"""Store bounds: max_bytes for the whole store and tenant_max_share per tenant, kept by eviction (expired first,
then least recently used; within the tenant over its share, else across tenants), tracked by running totals that a
restart reloads."""
import pytest
from helpers.request_cache import Clock, FakeSemantic, answer, chat, make, run

from strata.cache.request.store import Entry, SQLiteStore

ANSWER = "x" * 1000


def index_only():
    """A semantic layer that indexes (so evictions must reach it) but never serves: hash collisions between
    "number 002" and "number 020" must not turn a write into a hit."""
    semantic = FakeSemantic()
    semantic.lookup = lambda *args: None
    return semantic


def poem(i):
    return f"Write poem number {i:03d}"       # same length for every i: every entry has the same size


def write(cache, clock, tenant, i):
    clock.t += 1                                # distinct write times: a strict least-recently-used order
    run(answer(cache, chat(poem(i), tenant=tenant), ANSWER))


@pytest.fixture(scope="module")
def entry_bytes():
    """What one such entry counts against the bounds (tenant names of 5 characters; shorter ones weigh less)."""
    clock = Clock()
    cache = make(semantic=index_only(), clock=clock)
    write(cache, clock, "probe", 0)
    size = cache.store.usage()["bytes"]
    cache.close()
    return size


def stored(cache, tenant):
    return sorted(int(e.text.rsplit(" ", 1)[1]) for e in cache.store.entries() if e.tenant == tenant)


def test_a_tenant_at_its_share_evicts_only_its_own_entries(entry_bytes):
    clock = Clock()
    cache = make(semantic=index_only(), clock=clock, max_bytes=int(10.5 * entry_bytes), tenant_max_share=0.5)
    for i in range(3):
        write(cache, clock, "quiet", i)
    for i in range(20):
        write(cache, clock, "noisy", i)
        usage = cache.store.usage()
        assert usage["tenants"]["noisy"] <= usage["tenant_max_bytes"] and usage["bytes"] <= usage["max_bytes"]
    assert stored(cache, "quiet") == [0, 1, 2]                 # the other tenant's entries survive
    assert stored(cache, "noisy") == [15, 16, 17, 18, 19]      # its own least recently used went
    stats = cache.stats()
    assert stats["counters"]["store"] == {"evicted_tenant_lru": 15}
    assert stats["store_bytes"]["tenants"] == {"quiet": 3 * entry_bytes, "noisy": 5 * entry_bytes}
    assert stats["entries"] == {"memory": 8, "store": 8, "semantic": 8}     # evicted from every layer
    assert run(cache.lookup(chat(poem(0), tenant="noisy"))).layer == "miss"
    cache.close()


def test_a_recent_hit_keeps_an_entry_over_a_newer_unused_one(entry_bytes):
    clock = Clock()
    cache = make(semantic=index_only(), clock=clock, max_bytes=int(3.5 * entry_bytes))
    for i in range(3):
        write(cache, clock, "t", i)
    clock.t += 1
    assert run(cache.lookup(chat(poem(0), tenant="t"))).layer == "exact"     # 0 is now the most recently used
    run(cache.drain())                                                     # hit time persisted
    write(cache, clock, "t", 3)
    assert stored(cache, "t") == [0, 2, 3] and cache.stats()["counters"]["store"] == {"evicted_lru": 1}
    cache.close()


def test_the_global_bound_holds_across_tenants(entry_bytes):
    clock = Clock()
    cache = make(semantic=index_only(), clock=clock, max_bytes=int(6.5 * entry_bytes))
    for i in range(30):
        write(cache, clock, "abc"[i % 3], i)
        assert cache.store.usage()["bytes"] <= 6.5 * entry_bytes
    assert sorted(stored(cache, "a") + stored(cache, "b") + stored(cache, "c")) == list(range(24, 30))
    assert cache.stats()["counters"]["store"] == {"evicted_lru": 24}
    cache.close()


def test_expired_entries_go_before_least_recently_used_ones():
    store = SQLiteStore(None, max_bytes=5000)

    def put(i, created_at, expires_at):
        return store.put(Entry(f"e{i}", "t|m|s|c|p", "t", "m", f"question {i}", "a" * 1000, created_at, expires_at))

    assert put(0, 10.0, 1e9) == []                     # the least recently used ...
    assert put(1, 20.0, 50.0) == []                    # ... and one that expires at 50
    assert put(2, 30.0, 1e9) == [] and put(3, 40.0, 1e9) == []
    assert put(4, 100.0, 1e9) == [("e1", "expired")]
    assert put(5, 110.0, 1e9) == [("e0", "lru")]
    assert put(5, 120.0, 1e9) == []                    # replacing an entry frees its old bytes first
    assert len(store) == 4 and store.usage()["bytes"] <= 5000
    store.close()


def test_the_bounds_survive_a_restart_and_a_lowered_bound_applies_at_once(tmp_path, entry_bytes):
    clock = Clock()
    cache = make(tmp_path, semantic=index_only(), clock=clock, max_bytes=int(8.5 * entry_bytes))
    for i in range(12):
        write(cache, clock, "t", i)
    before = cache.store.usage()
    cache.close()
    reopened = make(tmp_path, semantic=index_only(), clock=clock, max_bytes=int(8.5 * entry_bytes))
    assert reopened.store.usage() == before and before["entries"] == 8      # totals reloaded, not reset
    for i in range(12, 15):
        write(reopened, clock, "t", i)
    assert stored(reopened, "t") == list(range(7, 15))
    reopened.close()
    smaller = make(tmp_path, semantic=index_only(), clock=clock, max_bytes=int(4.5 * entry_bytes))
    assert stored(smaller, "t") == list(range(11, 15)) and len(smaller.semantic) == 4
    smaller.close()


def test_an_entry_larger_than_a_tenant_may_hold_is_skipped(entry_bytes):
    cache = make(max_bytes=4 * entry_bytes, tenant_max_share=0.25)
    run(answer(cache, chat("Write a short poem"), "short"))
    _, _, computed = run(answer(cache, chat("Write a long poem"), "y" * (2 * entry_bytes)))
    assert computed == 1 and cache.stats()["counters"]["write"] == {"written": 1, "skipped_too_large": 1}
    assert len(cache.store) == 1 and run(cache.lookup(chat("Write a short poem"))).layer == "exact"
    cache.close()


@pytest.mark.parametrize("bad", [dict(max_bytes=0), dict(tenant_max_share=0.0), dict(tenant_max_share=1.5)])
def test_bad_bounds_are_a_value_error(bad):
    with pytest.raises(ValueError):
        make(**bad)
