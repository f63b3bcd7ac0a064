"""The shared Redis store against a real redis-server: two RequestCaches on one Redis stand for two replicas (the
HTTP drill with two servers is tests/reliability/test_replicas.py). Entries, TTL, namespaced keys and byte bounds
in Redis; writes and invalidations reaching the other replica through the stream; the cross-replica lease; an
outage served from the in-process layer, with the queued writes flushed and the index resynced on recovery."""
from __future__ import annotations

import asyncio
import random
import time

import pytest
import redis
from helpers.redis_server import RedisServer
from helpers.request_cache import FakeSemantic, answer, chat, run

from strata.cache.request.redis_store import _checksum as content_checksum
from strata.cache.request.request_cache import RequestCache, RequestCacheConfig
from strata.cache.request.store import Entry
from strata.cache.request.tinylfu import TinyLFU


@pytest.fixture(scope="module")
def server():
    redis_server = RedisServer().start()
    yield redis_server
    redis_server.kill()


@pytest.fixture
def url(server):
    if server.process is None:
        server.start()
    server.client().flushall()
    return server.url()


def replica(url, **cfg) -> RequestCache:
    return RequestCache(RequestCacheConfig(redis=url, **cfg), semantic=FakeSemantic(), rng=random.Random(0))


def eventually(check, timeout=2.0):
    """Poll until check() is truthy; returns how long it took (the stream's delivery time)."""
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < timeout, "not in sync in time"
        time.sleep(0.01)
    return time.monotonic() - start


def test_an_answer_on_one_replica_is_an_exact_and_a_semantic_hit_on_the_other(url, server):
    a, b = replica(url), replica(url)
    try:
        _, first, computed = run(answer(a, chat("What is the capital of France?"), "Paris."))
        assert first.layer == "miss" and computed == 1
        hit = run(b.lookup(chat("What is the capital of France?")))
        assert (hit.layer, hit.hit.text) == ("exact", "Paris.")
        eventually(lambda: len(b.semantic) == 1)           # the write reached B's index through the stream
        near = run(b.lookup(chat("What is the capital of France")))
        assert near.layer.startswith("semantic") and near.hit.text == "Paris."
        # stored in Redis with its TTL, under a key naming its tenant and model
        (key,) = server.client().keys("strata:default:m%401:e:*")
        stored = b.store.get(hit.hit.entry_id)
        assert key.decode().endswith(hit.hit.entry_id) and stored.answer == "Paris."
        assert abs(server.client().pttl(key) / 1000 - (stored.expires_at - time.time())) < 2
        assert b.stats()["redis"]["up"] and b.health()["status"] == "ok"
    finally:
        a.close()
        b.close()


def test_an_invalidation_on_one_replica_is_gone_on_the_other(url):
    a, b = replica(url), replica(url)
    try:
        run(a.lookup(chat("Which plan am I on?"))).complete("Gold.", tags=("billing",))
        run(a.drain())
        run(answer(a, chat("What is a monad?"), "A monoid in the category of endofunctors."))
        assert run(a.lookup(chat("Which plan am I on?"))).layer == "exact"      # in A's in-process layer
        eventually(lambda: len(b.semantic) == 2)
        assert b.invalidate(tag="billing") == 1
        eventually(lambda: len(a.semantic) == 1)
        gone = run(a.lookup(chat("Which plan am I on?")))
        assert gone.layer == "miss"
        gone.release()
        assert run(a.lookup(chat("What is a monad?"))).layer == "exact"        # the other entry stays
    finally:
        a.close()
        b.close()


def test_tenants_never_see_each_others_entries(url, server):
    a, b = replica(url), replica(url)
    try:
        run(answer(a, chat("When was the company founded?", tenant="acme"), "In 1999."))
        eventually(lambda: len(b.semantic) == 1)
        other = run(b.lookup(chat("When was the company founded?", tenant="globex")))
        assert other.layer == "miss"
        other.release()
        assert b.store.ids(tenant="globex") == [] and len(b.store.ids(tenant="acme")) == 1
        assert b.invalidate(tenant="globex") == 0
        assert run(b.lookup(chat("When was the company founded?", tenant="acme"))).hit.text == "In 1999."
        assert b.store.usage()["tenants"].keys() == {"acme"}
    finally:
        a.close()
        b.close()


def test_byte_bounds_evict_in_redis_and_the_other_replica_forgets_too(url):
    """The same rules as the SQLite store: a tenant over its share evicts its own least recently used entries."""
    a, b = replica(url, max_bytes=20_000, tenant_max_share=0.5), replica(url, max_bytes=20_000, tenant_max_share=0.5)
    try:
        for i in range(6):
            run(answer(a, chat(f"Tell me fact number {i}", tenant="acme"), f"fact {i} " + "x" * 2500))
        run(answer(a, chat("Tell me the other fact", tenant="globex"), "other " + "y" * 2500))
        usage = a.store.usage()
        assert usage["tenants"]["acme"] <= 10_000 and usage["tenants"]["globex"] > 2500
        evicted = a.stats()["counters"]["store"]["evicted_tenant_lru"]
        assert evicted >= 2
        kept = set(a.store.ids(tenant="acme"))
        assert len(kept) == 6 - evicted
        eventually(lambda: set(b.semantic.ids()) == kept | set(a.store.ids(tenant="globex")))
        oldest = run(b.lookup(chat("Tell me fact number 0", tenant="acme")))
        assert oldest.layer == "miss"       # least recently used: evicted first
        oldest.release()
    finally:
        a.close()
        b.close()


def test_a_question_in_flight_on_one_replica_is_computed_once(url):
    a, b = replica(url), replica(url)
    try:
        async def go():
            leader = await a.lookup(chat("Summarise the report."))
            assert leader.layer == "miss"
            waiting = asyncio.ensure_future(b.lookup(chat("Summarise the report.")))
            await asyncio.sleep(0.2)
            assert not waiting.done()               # B holds back: A has the lease
            leader.complete("It went well.")
            await a.drain()
            return await asyncio.wait_for(waiting, 3)

        follower = run(go())
        assert (follower.layer, follower.reason, follower.hit.text) == ("exact", "lease", "It went well.")
        assert b.stats()["counters"]["lease"] == {"answered": 1}
    finally:
        a.close()
        b.close()


def test_a_leader_that_gives_up_hands_the_lease_over_at_once_and_a_stored_answer_frees_it(url, server):
    a, b = replica(url, lease_wait_s=5.0), replica(url)
    try:
        async def go():
            leader = await a.lookup(chat("Draft the memo."))
            waiting = asyncio.ensure_future(b.lookup(chat("Draft the memo.")))
            await asyncio.sleep(0.2)
            assert not waiting.done()               # B holds back: A has the lease
            started = time.monotonic()
            leader.fail(RuntimeError("engine fault"))
            follower = await asyncio.wait_for(waiting, 3)
            return follower, time.monotonic() - started

        follower, waited = run(go())
        assert follower.layer == "miss" and follower.leased and waited < 1.0    # not lease_wait_s (5 s)
        assert b.stats()["counters"]["lease"] == {"taken_over": 1}
        assert server.client().keys("*:lease:*")                                 # B holds it now
        follower.complete("Memo drafted.")
        run(b.drain())
        assert eventually(lambda: not server.client().keys("*:lease:*")) < 1.0  # given back once stored
        assert (run(a.lookup(chat("Draft the memo."))).hit.text) == "Memo drafted."
    finally:
        a.close()
        b.close()


def test_redis_down_serves_from_memory_queues_writes_and_catches_up(url, server):
    a, b = replica(url, redis_queue_size=3), replica(url)
    try:
        run(answer(a, chat("What is a B-tree?"), "A balanced search tree."))
        server.kill()
        assert run(a.lookup(chat("What is a B-tree?"))).hit.text == "A balanced search tree."     # L1
        for i in range(5):          # misses computed and answered; writes queued, the two oldest dropped
            got, lookup, computed = run(answer(a, chat(f"Outage question {i}"), f"outage answer {i}"))
            assert (got, computed) == (f"outage answer {i}", 1)
        assert run(a.lookup(chat("Outage question 4"))).hit.text == "outage answer 4"     # served locally
        eventually(lambda: not a.stats()["redis"]["up"])
        link = a.stats()["redis"]
        assert (link["queue"], link["dropped"]) == (3, 2) and link["errors"] >= 1
        a.faults.report("lookup", ConnectionError("refused"))   # what a lookup meets before the breaker opens
        health = a.health()
        assert health["status"] == "degraded" and "redis down" in health["reason"]
        synced = a.stats()["redis"]["resyncs"], b.stats()["redis"]["resyncs"]
        server.start()
        # back in sync: the breaker closes before the index is rebuilt, so wait for the resync itself, not "up"
        eventually(lambda: a.stats()["redis"]["resyncs"] > synced[0] and b.stats()["redis"]["resyncs"] > synced[1],
                   timeout=5)
        assert a.stats()["redis"]["up"] and b.stats()["redis"]["up"]
        assert a.stats()["redis"]["queue"] == 0 and a.health()["status"] == "ok"
        for i in (2, 3, 4):         # the queued ones reached Redis and B
            hit = run(b.lookup(chat(f"Outage question {i}")))
            assert hit.layer == "exact" and hit.hit.text == f"outage answer {i}"
        lost = run(b.lookup(chat("Outage question 0")))
        assert lost.layer == "miss"         # dropped (counted above), not silently half-written
        lost.release()
    finally:
        a.close()
        b.close()


def test_a_write_that_fails_while_the_link_is_up_is_never_replayed_over_a_later_invalidation(url, server):
    """Audit 12: a put that met one link error (and may have landed) was queued while the breaker stayed closed,
    then replayed at the next recovery, after an invalidation had deleted it: the invalidated answer came back."""
    a = replica(url)
    try:
        put, failures = a.store._put, []

        def flaky_put(entry, size):
            if not failures:
                failures.append(entry.entry_id)
                put(entry, size)                            # it landed; the reply was lost
                raise redis.ConnectionError("reply lost")
            return put(entry, size)

        a.store._put = flaky_put
        run(answer(a, chat("What is a B-tree?"), "OLD ANSWER"))
        assert a.stats()["redis"]["up"] and a.stats()["redis"]["queue"] == 0 and a.stats()["redis"]["dropped"] == 1
        assert a.invalidate(tenant="default") == 1
        server.kill()                                       # a later outage, and its recovery flushes the queue
        eventually(lambda: not a.stats()["redis"]["up"])
        server.start()
        eventually(lambda: a.stats()["redis"]["up"], timeout=5)
        lookup = run(a.lookup(chat("What is a B-tree?")))
        assert lookup.layer == "miss" and len(a.store) == 0
        lookup.release()
    finally:
        a.close()


def test_a_replica_that_fell_behind_the_stream_rebuilds_its_index(url):
    a, b = replica(url, redis_stream_len=4), replica(url)
    try:
        b.store.follower.stop()             # B stops reading; A writes more than the stream keeps
        for i in range(12):
            run(answer(a, chat(f"Gap question {i}"), f"gap answer {i}"))
        before = b.store.follower.resyncs
        b.store.follower.follow()           # reads what is left: the gap is noticed
        assert not b.store.breaker.up
        assert b.store.follower.recover() and b.store.follower.resyncs == before + 1
        assert len(b.semantic) == 12
    finally:
        a.close()
        b.close()


def test_a_malformed_hash_in_redis_is_skipped_and_replication_goes_on(url, server):
    """A hash written by hand or by another version (here a created_at that is no number) used to end the stream
    follower on every replica at its next resync, and stopped a new replica from starting."""
    a = replica(url)
    try:
        run(a.lookup(chat("Who invented the light bulb?"))).complete("Edison.", tags=("inv",))
        run(a.drain())
        run(answer(a, chat("What is a monad?"), "A monoid."))
        client = server.client()
        (key,) = [k for k in client.keys("strata:default:*:e:*") if client.hget(k, "answer") == b"A monoid."]
        client.hset(key, "created_at", "1.0.0")            # as another version might write it: its checksum matches
        client.hset(key, "checksum", str(content_checksum(client.hgetall(key))))
        b = replica(url)                    # starts: its first resync reads the bad hash
        try:
            assert b.store.malformed == 1 and len(b.semantic) == 1 and b.store.follower.thread.is_alive()
            assert run(b.lookup(chat("Who invented the light bulb?"))).layer == "exact"
            resyncs = b.store.follower.resyncs
            client.xadd("strata:stream", {"op": "put", "ids": key.decode().rsplit(":", 1)[1], "origin": "other"})
            b.store.breaker.failure(RuntimeError("a blip"), trip=True)      # what an outage leads to: a resync
            eventually(lambda: b.store.follower.resyncs > resyncs)
            assert b.store.breaker.up and b.store.follower.thread.is_alive() and b.store.malformed == 2
            assert a.invalidate(tag="inv") == 1                             # and events still arrive
            eventually(lambda: run(b.lookup(chat("Who invented the light bulb?"))).layer == "miss")
        finally:
            b.close()
    finally:
        a.close()


def test_an_answer_changed_in_redis_under_its_checksum_is_dropped_on_every_replica_never_served(url, server):
    """Redis keeps whatever it is given: a changed answer (a hand edit, a bad restore) passed for the cached one. Each
    hash holds a checksum of its content; a read that finds it changed deletes the entry (the stream tells the other
    replicas, whose layers forget it) and is a miss. Hit counters change freely; a hash without a checksum (written
    before there was one) is taken as it is, and so is one with fields a newer version added (the checksum covers the
    stored bytes, not what this version reads of them)."""
    a, b = replica(url), replica(url)
    try:
        run(answer(a, chat("What is a monad?"), "A monoid."))
        run(answer(a, chat("Who invented the light bulb?"), "Edison."))
        run(answer(a, chat("Where is Timbuktu?"), "In Mali."))
        eventually(lambda: len(b.semantic) == 3)
        client = server.client()
        keys = {client.hget(k, "answer"): k for k in client.keys("strata:default:*:e:*")}
        client.hset(keys[b"A monoid."], "answer", "A burrito.")
        client.hset(keys[b"Edison."], "hits", 41)
        client.hdel(keys[b"In Mali."], "checksum")
        newer = keys[b"Edison."]                # a newer version's hash, with a field this one does not know
        client.hset(newer, "reasoning", "none")
        client.hset(newer, "checksum", str(content_checksum(client.hgetall(newer))))
        missed = run(b.lookup(chat("What is a monad?")))
        assert missed.layer == "miss" and not client.exists(keys[b"A monoid."])
        missed.release()
        assert b.stats()["counters"]["store"]["damaged"] == 1
        eventually(lambda: len(a.semantic) == 2 and len(b.semantic) == 2)      # a had it in memory and indexed
        assert run(a.lookup(chat("What is a monad?"))).layer == "miss"
        assert run(b.lookup(chat("Who invented the light bulb?"))).hit.text == "Edison."
        assert run(b.lookup(chat("Where is Timbuktu?"))).hit.text == "In Mali."
    finally:
        a.close()
        b.close()


def test_a_resync_that_fails_for_another_reason_keeps_the_follower_and_says_redis_is_down(url, monkeypatch):
    a = replica(url)
    try:
        def broken() -> None:
            raise RuntimeError("a bug in a listener")
        monkeypatch.setattr(a, "resync", broken)
        a.store.breaker.failure(RuntimeError("a blip"), trip=True)
        time.sleep(1.0)                     # the probe retries every 0.5 s and keeps failing
        assert a.store.follower.thread.is_alive() and not a.store.breaker.up
        assert a.health()["status"] == "degraded" and "redis down" in a.health()["reason"]
        monkeypatch.undo()
        eventually(lambda: a.store.breaker.up, timeout=3.0)
    finally:
        a.close()


def test_tinylfu_layer_is_bounded_by_entries_and_bytes():
    now = time.time()

    def entry(i, size):
        return Entry(f"id{i}", "p", "t", "m", f"q{i}", "x" * size, now, now + 60)

    by_count = TinyLFU(max_entries=10, max_bytes=10**9, clock=time.time)
    for i in range(200):
        by_count.put(entry(i, 10))
    assert len(by_count) <= 10 + 16                # theine applies its bound in batches of 16 writes
    by_bytes = TinyLFU(max_entries=1000, max_bytes=20_000, clock=time.time)
    for i in range(50):
        by_bytes.put(entry(i, 1000))
    assert by_bytes.bytes <= 20_000 and 0 < len(by_bytes) <= 20_000 // entry(0, 1000).size
    by_bytes.put(entry(99, 50_000))                 # larger than the whole budget: stays out
    assert by_bytes.get("id99") is None
    by_bytes.put(entry(98, 100))
    by_bytes.put(Entry("id98", "p", "t", "m", "q98", "y" * 50_000, now, now + 60))   # a refresh too large to keep
    assert by_bytes.get("id98") is None             # the older answer goes with it (audit 12: it kept serving)
    expired = TinyLFU(10, 10**6, clock=lambda: now + 120)
    expired.put(entry(1, 10))
    assert expired.get("id1") is None
