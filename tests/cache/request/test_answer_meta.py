"""An answer's metadata (finish reason, completion tokens) is stored with it and replayed with every hit, so a cut
answer is never passed off as complete; files written before the meta (and size) columns existed still open."""
import asyncio
import json
import sqlite3

import pytest
from helpers.request_cache import Clock, FakeSemantic, chat, make, run

from strata.cache.request.keys import build_key
from strata.cache.request.request_cache import AnswerMeta

CUT = AnswerMeta("length", 3)


def ask(text, max_tokens=3):
    return chat(text, sampling={"temperature": 0, "max_tokens": max_tokens})


def test_a_cut_answer_replays_length_and_serves_only_the_same_max_tokens(tmp_path):
    clock = Clock()
    cache = make(tmp_path, semantic=FakeSemantic(), clock=clock)

    async def write():
        lookup = await cache.lookup(ask("Explain the theory of relativity"))
        lookup.complete("Relativity is", meta=CUT)
        await cache.drain()

    run(write())
    cache.close()
    reopened = make(tmp_path, semantic=FakeSemantic(), clock=clock)    # meta survives the store

    async def go():
        exact = await reopened.lookup(ask("Explain the theory of relativity"))
        near = await reopened.lookup(ask("please explain the theory of relativity"))
        longer = []
        for question in ("Explain the theory of relativity", "please explain the theory of relativity"):
            for max_tokens in (4, None):
                longer.append(await reopened.lookup(ask(question, max_tokens)))
                longer[-1].release()
        return exact, near, longer

    exact, near, longer = run(go())
    assert (exact.layer, exact.hit.text, exact.hit.meta) == ("exact", "Relativity is", CUT)
    assert near.layer in ("semantic", "semantic-similar") and near.hit.meta == CUT
    # max_tokens is in the sampling hash, so in the exact key and in the partition the semantic index searches
    assert [lk.layer for lk in longer] == ["miss"] * 4
    reopened.close()


def test_single_flight_followers_get_the_meta():
    cache = make(semantic=FakeSemantic())

    async def go():
        leader = await cache.lookup(ask("Summarise the plot of Hamlet"))
        twin = asyncio.create_task(cache.lookup(ask("Summarise the plot of Hamlet")))
        neighbour = asyncio.create_task(cache.lookup(ask("summarise the plot of Hamlet please")))
        while sum(f.followers for f in cache.flights.flights.values()) < 2:
            await asyncio.sleep(0.005)
        leader.complete("A prince", meta=CUT)
        return await twin, await neighbour

    twin, neighbour = run(go())
    assert (twin.layer, twin.hit.meta) == ("shared", CUT)
    assert neighbour.layer in ("semantic", "semantic-similar") and neighbour.hit.meta == CUT
    cache.close()


def test_an_answer_without_meta_replays_none():
    cache = make()

    async def go():
        lookup = await cache.lookup(ask("Name a prime"))
        lookup.complete("7")
        await cache.drain()
        return await cache.lookup(ask("Name a prime"))

    assert run(go()).hit.meta is None
    cache.close()


@pytest.mark.parametrize("meta", [{"finish_reason": "length"}, "length"])
def test_bad_meta_is_a_clear_error_and_loses_nothing(meta):
    cache = make()

    async def go():
        lookup = await cache.lookup(ask("Name a colour"))
        with pytest.raises(ValueError, match="meta must be an AnswerMeta"):
            lookup.complete("Red", meta=meta)
        lookup.complete("Red", meta=AnswerMeta("stop", 1))          # the lookup is still open for the real answer
        await cache.drain()
        return await cache.lookup(ask("Name a colour"))

    assert run(go()).hit.meta == AnswerMeta("stop", 1)
    with pytest.raises(ValueError, match="finish_reason"):
        AnswerMeta("")
    with pytest.raises(ValueError, match="completion_tokens"):
        AnswerMeta("stop", -1)
    cache.close()


def test_meta_json_ignores_fields_a_later_version_adds():
    assert AnswerMeta.from_json(json.dumps({"finish_reason": "stop", "completion_tokens": 5, "new": 1})) == \
        AnswerMeta("stop", 5)


# The entries table as shipped before answer metadata (and entry sizes) were stored.
_OLD_SCHEMA = """
CREATE TABLE entries (
    entry_id TEXT PRIMARY KEY, partition TEXT NOT NULL, tenant TEXT NOT NULL, model TEXT NOT NULL,
    text TEXT NOT NULL, answer TEXT NOT NULL, created_at REAL NOT NULL, expires_at REAL NOT NULL,
    ttl_class TEXT NOT NULL, tags TEXT NOT NULL, semantic INTEGER NOT NULL, hits INTEGER NOT NULL,
    last_hit REAL, embedding BLOB);
CREATE INDEX entries_partition ON entries(partition);
CREATE INDEX entries_expires ON entries(expires_at);
CREATE TABLE entry_tags (tag TEXT NOT NULL, entry_id TEXT NOT NULL, PRIMARY KEY (tag, entry_id));
"""


def test_a_file_from_before_meta_opens_and_replays_none(tmp_path):
    clock = Clock()
    key = build_key(ask("Name a planet"))
    with sqlite3.connect(tmp_path / "cache.db") as old:
        old.executescript(_OLD_SCHEMA)
        old.execute("INSERT INTO entries VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    (key.exact, key.partition, key.tenant, key.model, key.text, "Mars", clock.t - 10, clock.t + 3600,
                     "default", "[]", 0, 0, None, None))
    cache = make(tmp_path, clock=clock)
    usage = cache.store.usage()                  # the size column was added and filled for the old row
    assert usage["entries"] == 1 and usage["tenants"] == {"default": usage["bytes"]} and usage["bytes"] > 100
    hit = run(cache.lookup(ask("Name a planet")))
    assert (hit.layer, hit.hit.text, hit.hit.meta) == ("exact", "Mars", None)

    async def write():
        lookup = await cache.lookup(ask("Name a moon"))
        lookup.complete("Titan", meta=CUT)
        await cache.drain()

    run(write())
    cache.close()
    reopened = make(tmp_path, clock=clock)
    assert run(reopened.lookup(ask("Name a moon"))).hit.meta == CUT
    reopened.close()
