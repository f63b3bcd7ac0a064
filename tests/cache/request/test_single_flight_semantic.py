"""Single-flight across similar questions: a request waits for a pending neighbour only where the semantic layer's
decision (cosine floor, cross-encoder, certified tiers) would serve it from that question were it stored."""
import asyncio
import re
import threading
import time

import pytest
from helpers.request_cache import FakeSemantic, chat, make, run

from strata.cache.request.embedders import HashEmbedder
from strata.cache.request.semantic import SemanticCache


@pytest.fixture(scope="module")
def e5():
    """The shipped semantic layer (e5-small, the cross-encoder) with tiers certified for a 5% bound: at the default 2%
    the shipped calibration pairs certify nothing, so nothing would be shared."""
    return SemanticCache.create(max_error=0.05)


class DigitBlindEmbedder(HashEmbedder):
    """Cosine 1.0 between questions that differ only in a number, as an embedder close to saturation gives."""

    def encode(self, texts):
        return super().encode([re.sub(r"\d", "", t) for t in texts])


async def wait_until(condition, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def second_while_first_pending(cache, first, second):
    """`first` computes; `second` arrives while it is pending; the first answers only once the second has decided
    (it waits on the first, or computes itself). Returns both (text, lookup) and the questions computed."""
    computed = []

    def second_decided():
        return second in computed or any(f.followers for f in cache.flights.flights.values())

    async def compute(question):
        computed.append(question)
        if question == first:
            await wait_until(second_decided)
        return f"answer to {question}"

    leader = asyncio.create_task(cache.get_or_compute(chat(first), lambda: compute(first)))
    await wait_until(lambda: first in computed)         # pending, with its embedding
    results = await asyncio.gather(leader, cache.get_or_compute(chat(second), lambda: compute(second)))
    return results, computed


@pytest.mark.parametrize("first,second", [("lb to kg", "kg to lb"), ("Convert 5 lb to kg", "Convert 5 kg to lb")])
def test_a_reversed_conversion_never_waits_for_the_pending_one(e5, first, second):
    cache = make(semantic=e5)
    assert float(e5.embed(first) @ e5.embed(second)) > 0.99           # as close as cosine gets: the second stage decides
    (_, (text, lookup)), computed = run(second_while_first_pending(cache, first, second))
    assert computed == [first, second] and text == f"answer to {second}" and lookup.layer == "miss"
    cache.close()


def test_another_story_number_never_waits_for_the_pending_one(e5):
    semantic = SemanticCache(DigitBlindEmbedder(), e5.tiers, e5.scorer)
    cache = make(semantic=semantic)
    first, second = "Write story number 3 about a dragon", "Write story number 4 about a dragon"
    assert float(semantic.embed(first) @ semantic.embed(second)) == pytest.approx(1.0)
    (_, (text, lookup)), computed = run(second_while_first_pending(cache, first, second))
    assert computed == [first, second] and text == f"answer to {second}" and lookup.layer == "miss"
    cache.close()


@pytest.mark.parametrize("first,second", [
    ("How do I reverse a list in Python?", "How can I reverse a list in Python?"),
    ("What is the largest ocean on Earth?", "Which ocean is the largest on Earth?"),
])
def test_a_paraphrase_waits_for_the_pending_question_and_says_its_tier(e5, first, second):
    cache = make(semantic=e5)
    stored = e5.decide(second, [("x", float(e5.embed(first) @ e5.embed(second)), first)])
    assert stored is not None, "the paraphrase would be served were its pending neighbour stored"
    layer = {"serve": "semantic", "similar": "semantic-similar"}[stored.tier]
    (_, (text, lookup)), computed = run(second_while_first_pending(cache, first, second))
    assert computed == [first] and text == f"answer to {first}"
    assert (lookup.layer, lookup.reason, lookup.hit.layer) == (layer, "single-flight", layer)
    assert lookup.hit.similarity == pytest.approx(stored.similarity, abs=1e-6)
    assert cache.stats()["counters"]["single_flight"]["neighbour"] == 1
    cache.close()


def test_only_a_computed_answer_passes_to_a_neighbour():
    """A waits on B while B is still deciding; B then waits on C, which A's question was never compared with
    (and is too far from): A must compute rather than take C's answer through B."""
    c, b, a = "alpha beta gamma delta", "alpha beta gamma delta epsilon", "alpha beta gamma delta epsilon zeta eta"
    a_joined_b = threading.Event()

    class Holding(FakeSemantic):
        def decide(self, text, candidates):
            if text == b and candidates:                  # B's decision on C (a worker thread) waits until A chose B
                a_joined_b.wait(10)
            return super().decide(text, candidates)

    semantic = Holding()
    assert semantic.embed(a) @ semantic.embed(c) < semantic.min_similarity(a) <= semantic.embed(a) @ semantic.embed(b)
    cache = make(semantic=semantic)
    computed = []

    async def compute(question):
        computed.append(question)
        if question == c:
            await wait_until(lambda: flight(b) is not None and flight(b).following)
        return f"answer to {question}"

    def flight(text):
        return next((f for f in cache.flights.flights.values() if f.key.text == text), None)

    async def go():
        tc = asyncio.create_task(cache.get_or_compute(chat(c), lambda: compute(c)))
        await wait_until(lambda: c in computed)
        tb = asyncio.create_task(cache.get_or_compute(chat(b), lambda: compute(b)))
        await wait_until(lambda: flight(b) is not None and flight(b).embedding is not None)
        ta = asyncio.create_task(cache.get_or_compute(chat(a), lambda: compute(a)))
        await wait_until(lambda: flight(b).followers == 1)
        a_joined_b.set()
        return await asyncio.gather(tc, tb, ta)

    (_, (tb, lb), (ta, la)) = run(go())
    assert (tb, lb.layer) == (f"answer to {c}", "semantic-similar")
    assert (ta, la.layer) == (f"answer to {a}", "miss") and computed == [c, a]
    cache.close()
