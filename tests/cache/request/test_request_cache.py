"""RequestCache facade: hits, TTL, isolation, context, single-flight, guards, write-back, invalidation, restart."""
import asyncio
import json
import logging
import re
import sqlite3
import threading
import time

import numpy as np
import pytest
from helpers.request_cache import Clock, FakeSemantic, answer, chat, make, run

from strata.cache.request.request_cache import RequestCacheConfig
from strata.cache.request.store import Entry
from strata.server.bench.data_files import datasets_dir, packaged

BYPASS_QUERIES = packaged("bypass_queries.jsonl")


def test_exact_hit_after_write_back_and_counters():
    cache = make()

    async def go():
        _, first, n1 = await answer(cache, chat("What is the capital of France?"), "Paris.")
        # extra spaces fold; a full-width "？" after Latin text no longer does (test_keys: it may be the question)
        text, second, n2 = await answer(cache, chat("  What is the capital  of France? "), "unused")
        return first, second, text, n1, n2

    first, second, text, n1, n2 = run(go())
    assert (first.layer, n1) == ("miss", 1)
    assert (second.layer, second.hit.layer, second.hit.similarity, text, n2) == ("exact", "exact", 1.0, "Paris.", 0)
    assert second.reason == "factual"
    s = cache.stats()
    assert s["counters"]["exact"] == {"hit": 1, "miss": 1} and s["counters"]["write"]["written"] == 1
    assert s["hit_age_s"]["count"] == 1 and s["entries"]["store"] == 1
    assert s["similarity"]["count"] == 0                  # the histogram is for semantic hits only
    with pytest.raises(RuntimeError, match="already"):
        first.complete("twice")
    cache.close()


def test_ttl_expiry_with_jitter_on_fake_clock():
    clock = Clock()
    cache = make(clock=clock, ttl_jitter=0.1)

    async def go():
        await answer(cache, chat("Write a haiku about the sea"), "Waves.")          # default class: 1 h
        entry = cache.store.get(cache.store.ids()[0])
        ttl = entry.expires_at - entry.created_at
        assert 3240 <= ttl <= 3960 and ttl != 3600                                   # jittered within +-10 %
        clock.t += ttl - 1
        assert (await cache.lookup(chat("Write a haiku about the sea"))).layer == "exact"
        clock.t += 2
        assert (await cache.lookup(chat("Write a haiku about the sea"))).layer == "miss"

    run(go())
    cache.close()


def test_expired_entries_are_purged_from_every_layer():
    clock = Clock()
    cache = make(semantic=FakeSemantic(), clock=clock)
    run(answer(cache, chat("What is the status of the nightly build?"), "Green."))       # status: 5 min
    assert len(cache.store) == len(cache.semantic) == 1
    clock.t += 400
    run(answer(cache, chat("Write a haiku about rain"), "Drops."))                       # writer idles -> purge
    assert len(cache.store) == len(cache.semantic) == 1 and len(cache.exact) == 1
    assert cache.store.entries().__next__().text == "Write a haiku about rain"
    cache.close()


@pytest.mark.parametrize("leaky", [False, True])
def test_tenant_isolation_even_at_similarity_one(leaky):
    semantic = FakeSemantic(leaky=leaky)
    cache = make(semantic=semantic)

    async def go():
        await answer(cache, chat("Summarise our holiday plan for the team offsite", tenant="acme"), "ACME SECRET")
        other = await cache.lookup(chat("Summarise our holiday plan for the team offsite", tenant="globex"))
        same = await cache.lookup(chat("Summarise our holiday plan for the team offsite", tenant="acme"))
        return other, same

    other, same = run(go())
    assert other.layer == "miss" and other.hit is None
    assert same.hit.text == "ACME SECRET"
    if leaky:
        assert cache.stats()["counters"]["semantic"]["rejected"] == 1     # the facade refused the index's cross-tenant match
    cache.close()


@pytest.mark.parametrize("leaky", [False, True])
def test_follow_ups_never_hit_an_entry_made_under_another_context(leaky):
    rows = json.loads((datasets_dir() / "en_contextual_queries.json").read_text())       # all 128 conversations
    cache = make(semantic=FakeSemantic(leaky=leaky))

    async def go():
        for row in rows:        # each follow-up cached under its own conversation
            history = [{"role": "user", "content": row["Main Query"]},
                       {"role": "assistant", "content": row["Main Query Response"]}]
            await answer(cache, chat(row["Follow-Up Query"], history=history), row["Follow Up Query Response"])
        hits = []
        for i, row in enumerate(rows):  # the same follow-up under another conversation, and with none at all
            other = rows[(i + 1) % len(rows)]
            history = [{"role": "user", "content": other["Main Query"]},
                       {"role": "assistant", "content": other["Main Query Response"]}]
            for h in (history, ()):
                lookup = await cache.lookup(chat(row["Follow-Up Query"], history=h))
                hits.append(lookup.hit)
                if lookup.hit is None and lookup.layer == "miss":
                    lookup.fail(RuntimeError("not computed in this test"))
        return hits

    hits = run(go())
    assert hits == [None] * len(hits)
    assert cache.stats()["counters"]["write"]["written"] >= 100    # the follow-ups were cacheable, so this is a real check
    cache.close()


def test_single_flight_identical_misses_compute_once():
    cache = make()
    calls = []

    async def compute():
        calls.append(1)
        await asyncio.sleep(0.05)
        return "one answer"

    async def go():
        results = await asyncio.gather(*[cache.get_or_compute(chat("Explain quicksort"), compute) for _ in range(8)])
        return results

    results = run(go())
    assert len(calls) == 1
    assert {text for text, _ in results} == {"one answer"}
    # followers got a concurrent twin's answer: labelled "shared" (not "exact": nothing was stored yet), with its source
    assert sorted(lookup.layer for _, lookup in results) == ["miss"] + ["shared"] * 7
    assert {lookup.hit.source for _, lookup in results if lookup.hit} == {"miss"}
    counters = cache.stats()["counters"]
    assert counters["single_flight"]["follower"] == 7 and counters["shared"]["hit"] == 7
    assert "exact" not in counters or "hit" not in counters["exact"]
    cache.close()


def test_single_flight_semantic_neighbour_waits_for_pending_leader():
    cache = make(semantic=FakeSemantic())
    calls = []

    async def compute():        # the leader answers only once the other request waits on it, however slow the CPU
        calls.append(1)
        for _ in range(1000):
            if any(f.followers for f in cache.flights.flights.values()):
                break
            await asyncio.sleep(0.005)
        return "Quicksort picks a pivot and partitions."

    async def go():
        return await asyncio.gather(cache.get_or_compute(chat("Explain quicksort algorithm please"), compute),
                                    cache.get_or_compute(chat("please explain quicksort algorithm"), compute))

    (t1, l1), (t2, l2) = run(go())
    assert len(calls) == 1 and t1 == t2
    assert {l1.layer, l2.layer} == {"miss", "semantic"}
    cache.close()


def test_leader_failure_reaches_followers_and_negative_cache_then_expires():
    clock = Clock()
    cache = make(clock=clock, negative_ttl_s=2.0)
    calls = []

    async def boom():
        calls.append(1)
        await asyncio.sleep(0.02)
        raise RuntimeError("engine down")

    async def go():
        results = await asyncio.gather(*[cache.get_or_compute(chat("Explain heapsort"), boom) for _ in range(3)],
                                       return_exceptions=True)
        assert len(calls) == 1 and all(isinstance(r, RuntimeError) for r in results)
        again = await cache.lookup(chat("Explain heapsort"))
        assert again.layer == "negative" and str(again.error) == "engine down"
        clock.t += 3
        later = await cache.lookup(chat("Explain heapsort"))
        assert later.layer == "miss"
        later.complete("fine now")

    run(go())
    cache.close()


def test_cancelled_leader_releases_followers_to_compute():
    cache = make()
    started = []

    async def slow():
        started.append(1)
        await asyncio.sleep(10)
        return "never"

    async def fast():
        started.append(1)
        return "follower computed"

    async def go():
        leader = asyncio.create_task(cache.get_or_compute(chat("Explain mergesort"), slow))
        await asyncio.sleep(0.01)
        follower = asyncio.create_task(cache.get_or_compute(chat("Explain mergesort"), fast))
        await asyncio.sleep(0.01)
        leader.cancel()
        return await follower

    text, lookup = run(go())
    assert (text, lookup.layer, len(started)) == ("follower computed", "miss", 2)
    cache.close()


def test_penetration_guard_marks_a_client_varying_a_number():
    semantic = FakeSemantic()
    semantic.lookup = lambda text, partition, embedding=None: None        # every variant misses
    cache = make(semantic=semantic, miss_limit=3)

    async def go():
        reasons = []
        for n in range(10, 16):
            req = chat(f"Recommend a restaurant for {n} people", client_id="bot-1")
            _, lookup, _ = await answer(cache, req, f"Table for {n}")
            reasons.append(lookup.reason)
        embeds = semantic.embeds
        other_client = await cache.lookup(chat("Recommend a restaurant for 99 people", client_id="human"))
        return reasons, embeds, other_client

    reasons, embeds, other = run(go())
    assert reasons == ["default"] * 4 + ["penetration-guard"] * 2
    assert embeds == 4 + 4                       # 4 lookups + 4 writes; guarded requests embed nothing
    assert cache.stats()["counters"]["write"]["written"] == 4           # guarded misses are not written
    assert (other.layer, other.reason) == ("miss", "default")           # another client is not affected
    cache.close()


def test_full_write_queue_drops_without_blocking():
    cache = make(write_queue_size=1)
    gate = threading.Event()
    cache.writer.handle = lambda job: gate.wait(5)        # a stuck writer

    async def go():
        for i in range(5):
            lookup = await cache.lookup(chat(f"Write limerick {i}"))
            lookup.complete(f"limerick {i}")

    run(go())
    dropped = cache.stats()["counters"]["write"]["dropped"]
    gate.set()
    assert dropped >= 3
    cache.close()


def test_pii_responses_and_untemplatable_requests_are_not_written():
    cache = make()

    async def go():
        await answer(cache, chat("How do I contact support?"), "Mail help@corp.example or call +1 415-555-0100")
        await answer(cache, chat("My email is bob@example.com, explain TCP"), "TCP is a transport protocol.")
        await answer(cache, chat("Write a welcome note to bob@example.com"), "Welcome aboard, bob@example.com!")
        filled = await cache.lookup(chat("Write a welcome note to amy@example.org"))
        return filled

    filled = run(go())
    counters = cache.stats()["counters"]["write"]
    assert counters == {"skipped_pii": 1, "skipped_untemplatable": 1, "written": 1}
    assert filled.layer == "exact" and filled.hit.text == "Welcome aboard, amy@example.org!"
    stored = [e.answer for e in cache.store.entries()]
    assert stored == ["Welcome aboard, \u27e6EMAIL_1\u27e7!"]
    cache.close()


def test_an_answer_about_a_personal_value_is_never_refilled_with_another():
    """Audit: a warm-up entry for Alice answered Robert "Yes, Robert is a traditionally female name." (exact)."""
    cache = make()
    faq = [{"question": "My name is Alice. Is my name usually given to girls?",
            "answer": "Yes, Alice is a traditionally female name."},
           {"question": "My name is Alice. Recommend one novel to me.", "answer": "Alice, I would recommend Dune."}]
    assert cache.warmup(faq, model="m@1") == 1
    assert cache.stats()["counters"]["warmup"] == {"skipped_personal-value": 1}

    async def go():
        about = await cache.lookup(chat("My name is Robert. Is my name usually given to girls?"))
        carried = await cache.lookup(chat("My name is Robert. Recommend one novel to me."))
        return about, carried

    about, carried = run(go())
    assert (about.layer, about.reason) == ("bypass", "personal-value")
    assert carried.layer == "exact" and carried.hit.text == "Robert, I would recommend Dune."
    cache.close()


def test_every_bypass_query_is_bypassed_or_never_written():
    rows = [json.loads(line) for line in BYPASS_QUERIES.read_text().splitlines()]
    assert len(rows) >= 60 and {r["why"] for r in rows} == {"realtime", "money", "legal", "security", "pii"}
    assert any(re.search(r"[\u4e00-\u9fff]", r["query"]) for r in rows)
    cache = make(semantic=FakeSemantic())

    async def go():
        outcome = []
        for r in rows:
            for reply in ("I can help with that.", f"Noted: {r['query']}"):    # generic, and one that echoes the PII
                before = len(cache.store)
                _, lookup, _ = await answer(cache, chat(r["query"]), reply)
                stored = [e.answer + e.text for e in cache.store.entries()]
                leaked = r["why"] == "pii" and any(r["query"] in s for s in stored)
                outcome.append((r["query"], lookup.layer == "bypass" or (len(cache.store) == before or not leaked)))
                if r["why"] != "pii":
                    assert lookup.layer == "bypass", r
        return outcome

    outcome = run(go())
    bypass_rate = sum(ok for _, ok in outcome) / len(outcome)
    assert bypass_rate == 1.0, [q for q, ok in outcome if not ok]
    from strata.cache.request.pii import find_entities
    for e in cache.store.entries():          # whatever was written from PII questions holds no personal value
        assert not [x for x in find_entities(e.answer + " " + e.text) if x.kind != "city"], e
    cache.close()


def test_invalidation_by_id_tag_partition_model_tenant_and_similarity(tmp_path):
    faq = [
        {"question": "How do I install Strata?", "answer": "pip install strata", "tags": ["install"]},
        {"question": "How do I upgrade Strata?", "answer": "pip install -U strata", "tags": ["install"]},
        {"question": "What is the default port?", "answer": "8000", "ttl_class": "factual"},
        {"question": "What is the default port?", "answer": "8000", "model": "m@2"},
        {"question": "What is the default port?", "answer": "8000", "tenant": "acme"},
        {"question": "What is the weather today?", "answer": "sunny"},              # realtime: skipped
    ]
    cache = make(semantic=FakeSemantic())
    assert cache.warmup(faq, model="m@1") == 5
    hit = run(cache.lookup(chat("How do I install Strata?")))
    assert hit.layer == "exact" and hit.hit.text == "pip install strata"
    assert cache.invalidate(tag="install") == 2
    assert cache.invalidate(model="m@2") == 1
    assert cache.invalidate(partition="acme|m@1") == 1
    assert cache.invalidate(similar_to="what is the default port", min_similarity=0.9, tenant="other") == 0
    assert cache.invalidate(similar_to="what is the default port", min_similarity=0.9) == 1
    assert len(cache.store) == 0 and len(cache.semantic) == 0 and len(cache.exact) == 0
    assert run(cache.lookup(chat("How do I install Strata?"))).layer == "miss"
    with pytest.raises(ValueError, match="at least one"):
        cache.invalidate()
    with pytest.raises(ValueError, match="record 2: needs string fields"):
        cache.warmup([faq[0], {"question": "q"}], model="m@1")
    assert len(cache.store) == 0                            # nothing written when one record is bad
    cache.close()


def test_invalidate_by_entry_id_and_queued_writes_are_dropped():
    cache = make()
    gate = threading.Event()
    write = cache.writer.handle
    cache.writer.handle = lambda job: (gate.wait(5), write(job))       # a slow writer

    async def go():
        lookup = await cache.lookup(chat("Explain recursion"))
        lookup.complete("It calls itself.")                 # queued, not yet stored
        assert cache.invalidate(tenant="default") == 0      # nothing stored yet, but the queued write is now stale
        gate.set()
        await cache.drain()
        assert (await cache.lookup(chat("Explain recursion"))).layer == "miss"
        _, _, _ = await answer(cache, chat("Explain iteration"), "Loops.")
        hit = await cache.lookup(chat("Explain iteration"))
        assert cache.invalidate(entry_id=hit.hit.entry_id) == 1
        assert cache.invalidate(entry_id=hit.hit.entry_id) == 0

    run(go())
    assert cache.stats()["counters"]["write"] == {"skipped_invalidated": 1, "written": 1}
    cache.close()


def test_a_lookup_reading_the_store_during_an_invalidation_does_not_bring_the_entry_back():
    """A lookup that read an entry from the store while an invalidation ran must not promote it to memory: every
    later lookup would get it as an exact hit until its TTL (days), though the store no longer holds it."""
    cache = make()
    run(answer(cache, chat("Write a haiku about the sea"), "OLD ANSWER"))
    cache.exact.memory.clear()                          # e.g. after a restart: hits come from the store
    read = cache.store.get

    def racing_read(entry_id):
        entry = read(entry_id)
        threading.Thread(target=cache.invalidate, kwargs={"tenant": "default"}).start()
        time.sleep(0.2)                                 # the invalidation completes before the promotion
        return entry

    cache.store.get = racing_read
    racing = run(cache.lookup(chat("Write a haiku about the sea")))
    cache.store.get = read
    assert racing.layer == "exact" and len(cache.store) == 0     # it began before the invalidation ended
    after = run(cache.lookup(chat("Write a haiku about the sea")))
    assert after.layer == "miss"
    after.release()
    cache.close()


def test_an_entry_another_replica_wrote_is_not_indexed_after_an_invalidation_that_raced_its_read():
    """Audit 15: stored_elsewhere read the entry, an invalidation here deleted it and cleaned the index, then the
    read's add put the deleted id back in the index (a ghost that could take a lookup's one cross-encoder read)."""
    cache = make(semantic=FakeSemantic())
    run(answer(cache, chat("how do I bake sourdough bread at home"), "BREAD"))
    entry_id = cache.store.ids()[0]
    read = cache.store.get

    def racing_read(eid):
        entry = read(eid)
        worker = threading.Thread(target=cache.invalidate, kwargs={"tenant": "default"})
        worker.start()
        worker.join(0.3)                    # with the fix it waits for the write lock held around this read
        return entry

    cache.store.get = racing_read
    cache.stored_elsewhere(entry_id)
    cache.store.get = read
    deadline = time.monotonic() + 5
    while len(cache.store) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(cache.store) == 0 and entry_id not in cache.semantic.ids()
    cache.close()


def test_a_lookup_between_an_invalidations_forget_and_its_delete_does_not_bring_the_entry_back():
    """The same race one step later: the lookup reads the store after the entry left memory but before the store
    deleted it (nothing was forgotten during its own read, so it promotes)."""
    cache = make()
    run(answer(cache, chat("Write a haiku about the sea"), "OLD ANSWER"))
    entry_id = cache.store.ids()[0]
    delete = cache.store.delete
    cache.store.delete = lambda ids: (cache.exact.get(entry_id), delete(ids))[1]
    assert cache.invalidate(tenant="default") == 1
    cache.store.delete = delete
    after = run(cache.lookup(chat("Write a haiku about the sea")))
    assert after.layer == "miss"
    after.release()
    cache.close()


def test_restart_keeps_entries_and_rebuilds_the_semantic_index(tmp_path):
    clock = Clock()
    cache = make(tmp_path, semantic=FakeSemantic(), clock=clock)
    run(answer(cache, chat("Explain the TCP three way handshake"), "SYN, SYN-ACK, ACK."))
    run(cache.lookup(chat("Explain the TCP three way handshake")))
    cache.close()
    clock.t += 60
    semantic = FakeSemantic()
    reopened = make(tmp_path, semantic=semantic, clock=clock)
    assert len(semantic) == 1 and semantic.embeds == 1      # rebuilt from stored embeddings (one checked again)

    async def go():
        exact = await reopened.lookup(chat("Explain the TCP three way handshake"))
        near = await reopened.lookup(chat("explain the tcp three-way handshake"))
        return exact, near

    exact, near = run(go())
    assert exact.layer == "exact" and exact.hit.age_s == 60
    assert near.layer in ("semantic", "semantic-similar") and near.hit.text == "SYN, SYN-ACK, ACK."
    assert reopened.store.get(exact.hit.entry_id).hits == 1               # hit count persisted before the restart
    reopened.close()


def test_stored_vectors_of_another_embedder_of_the_same_width_are_embedded_again(tmp_path, caplog):
    """Audit 15: minilm and e5-small are both 384 wide, so a store written under one and reopened under the other
    indexed vectors of another space without a word; semantic hits on them were lost (or wrong without a second
    stage)."""
    cache = make(tmp_path, semantic=FakeSemantic())
    run(answer(cache, chat("Explain the TCP three way handshake"), "SYN, SYN-ACK, ACK."))
    cache.close()

    class OtherSpace(FakeSemantic):
        def embed(self, text):
            return np.roll(super().embed(text), 7)             # same width, another space

    semantic = OtherSpace()
    with caplog.at_level(logging.WARNING):
        reopened = make(tmp_path, semantic=semantic)
    assert "made by another embedder" in caplog.text
    (text, _, vector), = semantic.rows.values()
    assert np.allclose(vector, semantic.embed(text))
    near = run(reopened.lookup(chat("explain the tcp three-way handshake")))
    assert near.layer in ("semantic", "semantic-similar")
    reopened.close()


def test_an_answer_the_store_drops_for_its_checksum_leaves_the_semantic_index_too(tmp_path):
    """A stored row whose content changed under its checksum is dropped when read (test_store); the index in front must
    forget it then, or every later lookup closest to it reads as a miss until a restart instead of trying the next
    neighbour."""
    cache = make(tmp_path, semantic=FakeSemantic())
    closest, next_closest = "alpha bravo charlie delta echo foxtrot golf hotel india juliet", \
        "alpha bravo charlie delta echo foxtrot golf kilo lima"        # cosine 0.74 apart: both are written
    run(answer(cache, chat(closest), "answer one"))
    run(answer(cache, chat(next_closest), "answer two"))
    question = chat("alpha bravo charlie delta echo foxtrot golf hotel india kilo")     # 0.90 / 0.84 from them
    damaged = {cache.store.get(i).text: i for i in cache.store.ids()}[closest]
    cache.exact.memory.clear()                          # evicted from memory: the next read comes from the file
    with sqlite3.connect(str(tmp_path / "cache.db")) as db:
        db.execute("UPDATE entries SET answer = 'tampered' WHERE entry_id = ?", (damaged,))
    first = run(cache.lookup(question))
    assert first.layer == "miss" and damaged not in cache.semantic.ids()
    first.release()
    assert cache.stats()["counters"]["store"]["damaged"] == 1
    second = run(cache.lookup(question))
    assert second.layer == "semantic-similar" and second.hit.text == "answer two"
    cache.close()


def test_review_ring_and_similarity_histogram():
    cache = make(semantic=FakeSemantic(), review_below=0.999)

    async def go():
        await answer(cache, chat("Explain how binary search works on arrays"), "Halve the range each step.")
        return await cache.lookup(chat("Explain how binary search works on sorted arrays"))

    lookup = run(go())
    assert lookup.layer in ("semantic", "semantic-similar")
    review = cache.review()
    assert len(review) == 1 and review[0]["similarity"] == lookup.hit.similarity
    assert review[0]["cached"] == "Explain how binary search works on arrays"
    assert cache.stats()["similarity"]["count"] == 1
    with pytest.raises(ValueError):
        cache.review(-1)
    cache.close()


def test_sampled_requests_follow_the_temperature_rule():
    cache = make(semantic=FakeSemantic())

    async def go():
        unseeded = await cache.lookup(chat("Write a poem", sampling={"temperature": 0.8}))
        _, seeded, _ = await answer(cache, chat("Write a poem", sampling={"temperature": 0.8, "seed": 7}), "Roses.")
        again = await cache.lookup(chat("Write a poem", sampling={"temperature": 0.8, "seed": 7}))
        other_seed = await cache.lookup(chat("Write a poem", sampling={"temperature": 0.8, "seed": 8}))
        other_seed.fail(RuntimeError("skip"))
        return unseeded, again, other_seed

    unseeded, again, other_seed = run(go())
    assert (unseeded.layer, unseeded.reason) == ("bypass", "sampling")
    assert again.layer == "exact" and other_seed.layer == "miss"
    assert len(cache.semantic) == 0                                       # sampled answers never enter the semantic index
    cache.close()


def test_no_cache_skips_lookup_but_writes_and_no_store_does_neither():
    cache = make()

    async def go():
        _, fresh, _ = await answer(cache, chat("Explain DNS", no_cache=True), "v2")
        assert (fresh.layer, fresh.reason) == ("bypass", "no-cache")
        assert (await cache.lookup(chat("Explain DNS"))).hit.text == "v2"
        _, nostore, _ = await answer(cache, chat("Explain NTP", no_store=True), "x")
        assert nostore.layer == "bypass" and (await cache.lookup(chat("Explain NTP"))).layer == "miss"

    run(go())
    with pytest.raises(ValueError):
        run(cache.lookup("not a request"))
    cache.close()


def test_broken_semantic_layer_degrades_to_exact_only():
    semantic = FakeSemantic()
    semantic.lookup = lambda *a: (_ for _ in ()).throw(RuntimeError("index corrupt"))
    cache = make(semantic=semantic)

    async def go():
        _, miss, _ = await answer(cache, chat("Explain garbage collection"), "Mark and sweep.")
        return miss, await cache.lookup(chat("Explain garbage collection"))

    miss, hit = run(go())
    assert miss.layer == "miss" and hit.layer == "exact"
    assert cache.stats()["counters"]["semantic"]["error"] == 1
    cache.close()


def test_with_the_real_semantic_cache(tmp_path):
    from strata.cache.request import semantic as semantic_mod
    from strata.cache.request.calibration import Tiers
    from strata.cache.request.embedders import HashEmbedder

    def semantic():
        return semantic_mod.SemanticCache(HashEmbedder(), Tiers(serve=0.97, similar=0.85))

    clock = Clock()
    cache = make(tmp_path, semantic=semantic(), clock=clock)
    run(answer(cache, chat("How do I sort a list in Python?", tenant="acme"), "Use sorted(xs)."))
    cache.close()
    reopened = make(tmp_path, semantic=semantic(), clock=clock)

    async def go():
        near = await reopened.lookup(chat("how do i sort a list in python", tenant="acme"))
        other = await reopened.lookup(chat("How do I sort a list in Python?", tenant="globex"))
        other.fail(RuntimeError("not computed"))
        return near, other

    near, other = run(go())
    assert len(reopened.semantic) == 1
    assert near.layer in ("semantic", "semantic-similar") and near.hit.text == "Use sorted(xs)."
    assert other.hit is None
    reopened.close()


def test_a_dropped_or_hung_leader_does_not_block_the_next_request():
    cache = make(follow_timeout_s=0.05)

    async def go():
        forgotten = await cache.lookup(chat("Explain bubble sort"))
        assert forgotten.layer == "miss"                      # the caller forgets complete()/fail()/release()
        again = await cache.lookup(chat("Explain bubble sort"))
        assert again.layer == "miss"                          # waits follow_timeout_s for it, then leads
        hung = again                                          # now a leader that never answers
        follower = await cache.lookup(chat("Explain bubble sort"))
        assert follower.layer == "miss"                       # gave up after follow_timeout_s and leads itself
        follower.complete("Swap neighbours until sorted.")
        hung.fail(RuntimeError("late"))                       # a late failure does not hide the stored answer
        await cache.drain()
        return await cache.lookup(chat("Explain bubble sort"))

    assert run(go()).hit.text == "Swap neighbours until sorted."
    assert cache.stats()["counters"]["single_flight"]["timeout"] == 2
    cache.close()


def test_a_follower_that_stops_waiting_leaves_the_others_waiting():
    """The first follower to time out released every follower at once, so all computed while a slow leader still
    ran; each waits out its own time now, and the next request after a timeout leads afresh."""
    cache = make(follow_timeout_s=0.3)

    async def go():
        leader = await cache.lookup(chat("Explain merge sort"))
        early = asyncio.create_task(cache.lookup(chat("Explain merge sort")))
        await asyncio.sleep(0.2)
        late = asyncio.create_task(cache.lookup(chat("Explain merge sort")))       # joined 0.2 s after the first
        first = await early
        assert first.layer == "miss" and not late.done()         # the first gave up and leads; the second waits on
        leader.complete("Split, sort both halves, merge.")
        second = await late
        first.complete("Split, sort both halves, merge.")
        return second

    second = run(go())
    assert (second.layer, second.hit.text) == ("shared", "Split, sort both halves, merge.")
    cache.close()


def test_memory_layer_is_bounded_but_the_store_keeps_everything():
    cache = make(memory_max_entries=2)

    async def go():
        for i in range(5):
            await answer(cache, chat(f"Write limerick number {i}"), f"limerick {i}")
        assert len(cache.exact) == 2 and len(cache.store) == 5
        first = await cache.lookup(chat("Write limerick number 0"))        # evicted from memory, served from the store
        assert first.hit.text == "limerick 0"

    run(go())
    cache.close()
    tiny = make(memory_max_bytes=1000)
    run(answer(tiny, chat("Write a long essay"), "x" * 5000))
    assert len(tiny.exact) == 0 and run(tiny.lookup(chat("Write a long essay"))).hit.text == "x" * 5000
    short = Entry("e1", "p", "default", "m", "q", "short answer", time.time(), time.time() + 60)
    tiny.exact.memory.put(short)
    tiny.exact.memory.put(Entry("e1", "p", "default", "m", "q", "y" * 5000, time.time(), time.time() + 60))
    assert tiny.exact.memory.get("e1") is None      # a refresh too large to keep takes the older answer out too
    tiny.close()


def test_single_flight_never_joins_across_tenants():
    cache = make()
    calls = []

    async def compute():
        calls.append(1)
        mine = len(calls)
        await asyncio.sleep(0.02)
        return f"answer {mine}"

    async def go():
        return await asyncio.gather(cache.get_or_compute(chat("Explain shellsort", tenant="a"), compute),
                                    cache.get_or_compute(chat("Explain shellsort", tenant="b"), compute))

    (ta, la), (tb, lb) = run(go())
    assert len(calls) == 2 and ta != tb and la.layer == lb.layer == "miss"
    cache.close()


def test_tags_are_validated_and_usable_for_invalidation():
    cache = make()

    async def go():
        lookup = await cache.lookup(chat("Explain TLS"))
        with pytest.raises(ValueError, match="tags"):
            lookup.complete("x", tags="security")
        lookup.complete("Handshake, then symmetric keys.", tags=("docs", "tls"))
        await cache.drain()

    run(go())
    assert cache.invalidate(tag="tls") == 1
    cache.close()


def test_followers_of_a_semantic_hit_are_shared_and_say_its_layer():
    semantic = FakeSemantic()
    cache = make(semantic=semantic)
    run(answer(cache, chat("Explain how binary search works on arrays"), "Halve the range each step."))
    search = semantic.lookup

    def lookup_once_both_follow(*args):     # the leader's search (a worker thread) waits for its two twins to join
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not any(f.followers == 2 for f in list(cache.flights.flights.values())):
            time.sleep(0.005)
        return search(*args)

    semantic.lookup = lookup_once_both_follow

    async def go():
        return await asyncio.gather(*[cache.lookup(chat("Explain how binary search works on sorted arrays"))
                                      for _ in range(3)])

    lookups = run(go())
    assert sorted(lk.layer for lk in lookups) == ["semantic-similar", "shared", "shared"]
    assert {lk.hit.source for lk in lookups if lk.layer == "shared"} == {"semantic-similar"}
    assert sorted(lk.reason for lk in lookups) == ["conceptual", "single-flight", "single-flight"]
    assert {lk.hit.text for lk in lookups} == {"Halve the range each step."}
    cache.close()


def test_an_exact_only_twin_never_takes_the_semantic_answer_its_leader_got():
    """An exact-only twin of a request that got a semantic hit computes its own answer: it asked never to be answered
    from a similar question (it got the hit as "shared" before)."""
    semantic = FakeSemantic()
    cache = make(semantic=semantic)
    run(answer(cache, chat("Explain how binary search works on arrays"), "Halve the range each step."))
    search = semantic.lookup

    def lookup_once_the_twin_follows(*args):
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not any(f.followers for f in list(cache.flights.flights.values())):
            time.sleep(0.005)
        return search(*args)

    semantic.lookup = lookup_once_the_twin_follows
    question = "Explain how binary search works on sorted arrays"

    async def go():
        return await asyncio.gather(cache.lookup(chat(question)), cache.lookup(chat(question, mode="exact-only")))

    hit, twin = run(go())
    assert hit.layer == "semantic-similar"
    assert twin.layer == "miss" and twin.hit is None
    twin.complete("Its own answer.")
    cache.close()


def test_an_invalidation_while_an_answer_is_computed_voids_its_write():
    cache = make()
    answers = iter(["computed before the invalidation", "computed after"])

    async def go():
        lookup = await cache.lookup(chat("Name three primary colors"))
        await asyncio.to_thread(cache.invalidate, tenant="default")
        lookup.complete(next(answers))
        await cache.drain()
        return await cache.lookup(chat("Name three primary colors"))

    again = run(go())
    assert again.layer == "miss" and list(cache.store.entries()) == []
    cache.close()


@pytest.mark.parametrize("bad", [dict(memory_max_entries=0), dict(ttl_jitter=1.5), dict(temperature_rule="maybe"),
                                 dict(write_queue_size=0), dict(miss_limit=0),
                                 dict(embedder="none", semantic_calibration="mine.npz")])    # would go unread
def test_bad_config_is_a_value_error(bad):
    with pytest.raises(ValueError):
        RequestCacheConfig(**bad)


def test_a_released_miss_lets_its_followers_compute_at_once():
    """A leader that gives up before computing (client gone, engine refused) releases its followers explicitly:
    they do not wait for garbage collection or the follow timeout."""
    cache = make(follow_timeout_s=60)

    async def go():
        leader = await cache.lookup(chat("Explain heapsort"))
        follower = asyncio.create_task(cache.lookup(chat("Explain heapsort")))
        await asyncio.sleep(0.05)
        assert not follower.done()
        held = leader                     # still referenced: only an explicit release can free the follower
        held.release()
        second = await asyncio.wait_for(follower, 1.0)
        held.release()                    # idempotent
        return held, second

    leader, second = run(go())
    assert leader.layer == "miss" and second.layer == "miss"      # the follower leads now and computes itself
    with pytest.raises(RuntimeError, match="already"):
        leader.complete("too late")
    cache.close()


@pytest.mark.parametrize("second", ["Explain quicksort algorithm please", "please explain quicksort algorithm"])
def test_a_request_never_waits_on_its_own_flights(second):
    """One request's questions (a completions prompt list) are all looked up before any is computed: a repeat or a
    neighbour of an earlier one computes itself (and is not written twice) instead of waiting on its own request,
    while another request still waits on the flight as before."""
    cache = make(semantic=FakeSemantic(), follow_timeout_s=60)

    async def go():
        first = await cache.lookup(chat("Explain quicksort algorithm please", origin="r1"))
        again = await asyncio.wait_for(cache.lookup(chat(second, origin="r1")), 1.0)
        other = asyncio.create_task(cache.lookup(chat("Explain quicksort algorithm please", origin="r2")))
        await asyncio.sleep(0.05)
        assert not other.done()                     # another request follows the pending flight
        first.complete("Quicksort picks a pivot and partitions.")
        return first, again, await asyncio.wait_for(other, 1.0)

    first, again, other = run(go())
    assert first.layer == "miss" and again.layer in ("bypass", "miss")
    assert again.reason != "single-flight" and not (again.layer == "bypass" and again.write)
    assert (other.layer, other.hit.text) == ("shared", "Quicksort picks a pivot and partitions.")
    cache.close()


def test_hit_counts_are_never_lost_between_the_event_loop_and_the_writer(tmp_path):
    """_touch (event loop) and _persist_hits (writer thread) share the pending-hits map under one lock. The map here
    inserts slowly, so that without the lock the writer swaps it out mid-insert and that hit is never persisted."""

    class SlowInsert(dict):
        def __setitem__(self, key, value):
            time.sleep(0.05)
            super().__setitem__(key, value)

    cache = make(tmp_path)
    run(answer(cache, chat("What is a heap?"), "A tree with the heap property."))
    entry = cache.exact.get(next(iter(cache.store.ids())))
    cache._persist_hits()
    cache.touched = SlowInsert()
    loop_side = threading.Thread(target=cache._touch, args=(entry,))   # the event loop counting a hit
    loop_side.start()
    time.sleep(0.01)                                                   # ... and now mid-insert
    cache._persist_hits()                                              # the writer thread's idle work
    loop_side.join()
    cache._persist_hits()
    assert entry.hits == 1 and cache.store.get(entry.entry_id).hits == 1
    cache.close()


def test_store_reads_and_waits_stay_off_the_event_loop(tmp_path, caplog):
    """asyncio debug mode reports any callback over 50 ms; an exact lookup that misses memory reads SQLite while
    the writer thread holds the store's lock for 300 ms, and the event loop must not wait for it (nor for
    stats() or health(), which /metrics and /health call on it)."""
    cache = make(tmp_path, memory_max_entries=1)
    run(answer(cache, chat("What is a trie?"), "A prefix tree."))
    run(answer(cache, chat("What is a deque?"), "A double-ended queue."))     # evicts the trie from memory
    assert len(cache.exact) == 1

    def hold_store(seconds):
        with cache.store.lock:
            time.sleep(seconds)

    async def go():
        asyncio.get_running_loop().slow_callback_duration = 0.05
        holder = threading.Thread(target=hold_store, args=(0.3,))
        holder.start()
        await asyncio.sleep(0.02)
        ticks = 0

        async def tick():
            nonlocal ticks
            while holder.is_alive():
                ticks += 1
                await asyncio.sleep(0.01)

        ticker = asyncio.create_task(tick())
        assert cache.stats()["entries"]["store"] == 2 and cache.health()["status"] == "ok"   # running totals only
        hit = await cache.lookup(chat("What is a trie?"))
        await ticker
        holder.join()
        return hit, ticks

    with caplog.at_level(logging.WARNING, logger="asyncio"):
        hit, ticks = asyncio.run(go(), debug=True)
    assert hit.layer == "exact" and hit.hit.text == "A prefix tree."
    slow = [r.getMessage() for r in caplog.records if "took" in r.getMessage()]
    assert not slow, slow
    assert ticks >= 10              # the loop kept running other work while the store was busy
    cache.close()


def test_a_language_the_bound_turned_off_is_never_embedded_on_the_request_path():
    """zh off, en on: a Chinese paraphrase misses without an embedding at lookup (the write still embeds, for a
    later recalibration), an English one is looked up and served."""
    from strata.cache.request.calibration import OFF, Tiers, TierTable
    from strata.cache.request.embedders import HashEmbedder
    from strata.cache.request.semantic import SemanticCache

    class Counting(HashEmbedder):
        def __init__(self):
            super().__init__()
            self.texts = []

        def encode(self, texts):
            self.texts += texts
            return super().encode(texts)

    embedder = Counting()
    semantic = SemanticCache(embedder, TierTable(en=Tiers(serve=0.99, similar=0.6), zh=Tiers(OFF, OFF)))
    cache = make(semantic=semantic)
    for first, second in (("北京有哪些好吃的餐厅", "北京有哪些好吃的餐厅呢"),
                          ("which restaurants in Rome serve good pasta", "which restaurants in Rome serve good pasta?")):
        run(answer(cache, chat(first)))
        assert first in embedder.texts                     # written with its embedding either way
        embedder.texts.clear()
        lookup = run(cache.lookup(chat(second)))
        if first.isascii():
            assert lookup.layer in ("semantic", "semantic-similar") and embedder.texts == [second]
        else:
            assert lookup.layer == "miss" and embedder.texts == []
            assert cache.stats()["counters"]["semantic"]["off"] == 2      # the first question's lookup, and this one
        lookup.release()
    cache.close()


def test_a_repeat_while_the_answer_is_being_stored_is_served_from_its_flight():
    """Between an answer and its landing in the store (the writer thread embeds and writes it), a repeat takes the
    answer as "shared" instead of computing again; once stored it is an exact hit and the flight is gone."""
    cache = make()
    gate = threading.Event()
    write = cache.writer.handle
    cache.writer.handle = lambda job: gate.wait(10) and write(job)      # the write is slow to land
    computed = []

    async def compute():
        computed.append(1)
        return "Paris."

    async def go():
        first = await cache.get_or_compute(chat("Capital of France?"), compute)
        repeat = await cache.get_or_compute(chat("Capital of France?"), compute)
        gate.set()
        await cache.drain()
        await asyncio.sleep(0)                           # the flight's removal runs on the loop
        stored = await cache.get_or_compute(chat("Capital of France?"), compute)
        return first, repeat, stored

    (_, first), (text, repeat), (_, stored) = run(go())
    assert computed == [1] and first.layer == "miss" and text == "Paris."
    assert (repeat.layer, repeat.reason) == ("shared", "single-flight") and stored.layer == "exact"
    assert cache.flights.flights == {}
    cache.close()


def test_an_invalidation_drops_answers_still_on_their_way_to_the_store():
    cache = make()
    gate = threading.Event()
    write = cache.writer.handle
    cache.writer.handle = lambda job: gate.wait(10) and write(job)
    answers = iter(["old answer", "new answer"])

    async def compute():
        return next(answers)

    async def go():
        await cache.get_or_compute(chat("Summarise the plot of Hamlet"), compute)
        await asyncio.to_thread(cache.invalidate, tenant="default")
        await asyncio.sleep(0)
        text, lookup = await cache.get_or_compute(chat("Summarise the plot of Hamlet"), compute)
        gate.set()
        await cache.drain()
        return text, lookup

    text, lookup = run(go())
    assert (text, lookup.layer) == ("new answer", "miss")
    assert [e.answer for e in cache.store.entries()] == ["new answer"]      # the stale write was dropped too
    cache.close()


@pytest.mark.parametrize("leaky", [False, True])
def test_a_miss_asked_for_drafts_gets_its_closest_unserved_answers_never_another_tenants(leaky):
    """--speculative cache: the answers of the closest stored questions that did not serve go back with the miss,
    filtered as a hit would be (a leaky index proves the facade checks the tenant itself)."""
    cache = make(semantic=FakeSemantic(leaky=leaky))
    run(answer(cache, chat("how do I bake sourdough bread at home"), "ACME BREAD"))
    run(answer(cache, chat("how do I bake sourdough bread at home", tenant="globex"), "GLOBEX BREAD"))
    lookup = run(cache.lookup(chat("how long should bread dough rise", draft_answers=2)))
    assert lookup.layer == "miss" and lookup.drafts == ("ACME BREAD",)
    lookup.release()
    plain = run(cache.lookup(chat("how long should bread dough rise")))
    assert plain.layer == "miss" and plain.drafts == ()
    plain.release()


def test_a_leader_cancelled_or_failing_while_reading_drafts_never_leaves_identical_requests_waiting():
    """Audit 12: a client that left while its drafts were read left the flight open, so every identical request
    waited follow_timeout_s; a failing read of the drafts now costs the drafts, not the request."""
    semantic = FakeSemantic()
    candidates, started = semantic.candidates, threading.Event()

    def slow_candidates(*args, **kwargs):
        started.set()
        time.sleep(0.3)
        return candidates(*args, **kwargs)

    semantic.candidates = slow_candidates
    cache = make(semantic=semantic, follow_timeout_s=5.0)

    async def go():
        leader = asyncio.create_task(cache.lookup(chat("Explain quicksort", draft_answers=2)))
        await asyncio.to_thread(started.wait, 5)
        leader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leader
        begin = time.monotonic()
        next_one = await cache.lookup(chat("Explain quicksort"))
        assert next_one.layer == "miss" and time.monotonic() - begin < 2   # led at once, not after 5 s
        next_one.release()
        semantic.candidates = lambda *a, **k: 1 / 0
        failing = await cache.lookup(chat("Explain quicksort", draft_answers=2))
        assert failing.layer == "miss" and failing.drafts == ()
        failing.complete("Pick a pivot, partition, recurse.")
        await cache.drain()
        assert (await cache.lookup(chat("Explain quicksort"))).layer == "exact"

    run(go())
    assert cache.flights.flights == {}
    cache.close()


def test_a_language_not_served_semantically_still_gets_drafts():
    """Audit: --speculative cache drafted nothing in English at the default bound, where English is not served;
    drafts are verified by the model, so they need no certified threshold."""
    semantic = FakeSemantic()
    semantic.serves = lambda text: False
    cache = make(semantic=semantic)
    run(answer(cache, chat("how do I bake sourdough bread at home"), "ACME BREAD"))
    lookup = run(cache.lookup(chat("how long should bread dough rise", draft_answers=2)))
    assert lookup.layer == "miss" and lookup.drafts == ("ACME BREAD",)
    lookup.release()
    assert cache.stats()["counters"]["semantic"]["off"] == 2             # both lookups: no search, no hit
