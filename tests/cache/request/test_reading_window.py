"""The reading-window rule: a pair too long for the second stage's window is not read, so it is never served; the
trimmed model would judge two different questions at the end of one long text as the same."""
import numpy as np

from strata.cache.request.cross_encoder import RULED_OUT, fits, shared_cross_encoder
from strata.cache.request.semantic import SemanticCache

PASSAGE = "Here is a long passage about the history of the city. " * 12
LONG_PAIR = (PASSAGE + "Who founded the city?", PASSAGE + "What is the population today?")


def test_fits_counts_the_layout_tokens():
    assert fits([1] * 60, [2] * 64, 128) and not fits([1] * 61, [2] * 64, 128)


def test_a_pair_longer_than_the_window_is_ruled_out_and_one_that_fits_is_read():
    ce = shared_cross_encoder()
    assert "window" in ce.version.split("+")
    tok = ce._tokenizer
    assert not fits(tok.token_ids(LONG_PAIR[0]), tok.token_ids(LONG_PAIR[1]), ce.max_len)
    assert ce.logit(*LONG_PAIR) > 0                 # what the model says of the trimmed pair: "same"
    assert ce.score(*LONG_PAIR) == RULED_OUT
    short = ("How do I boil an egg?", "What's the way to boil an egg?")
    assert ce.score(*short) == ce.logit(*short)
    # the longest pair that still fits is read whole: one word more and it would not fit
    query = "Who founded this city?"
    words = ("Who founded the city? " + "It has a long history and many old buildings. " * 20).split()
    while not fits(tok.token_ids(" ".join(words)), tok.token_ids(query), ce.max_len):
        longer = words.pop()
    assert not fits(tok.token_ids(" ".join([*words, longer])), tok.token_ids(query), ce.max_len)
    cached = " ".join(words)
    assert ce.score(cached, query) == ce.logit(cached, query)


def test_two_questions_at_the_end_of_one_long_text_are_not_served():
    """Audit (2026-12-08): at a 5% bound the answer to "<passage> What is the population today?" was served for
    "<passage> Who founded the city?" (semantic-similar, decision score 6.18): the model read only the passage."""
    cache = SemanticCache.create(max_error=0.05)
    cached, query = LONG_PAIR
    cosine = float(np.dot(cache.embed(cached), cache.embed(query)))
    assert cosine >= cache.min_similarity(query)    # close enough to be read: the rule, not the floor, refuses it
    assert cache.decide(query, [("x", cosine, cached)]) is None
