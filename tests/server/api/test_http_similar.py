"""Semantic tiers over HTTP with the deterministic "hash" embedder (cosine >= 0.95 serves, >= 0.85 serves with a
note): headers, the similar-question note per request and per server, and the review route."""
from __future__ import annotations

import pytest
from helpers.http_server import admin, ask

from strata.server.api.serving import SIMILAR_NOTE

pytestmark = [pytest.mark.http, pytest.mark.slow]

NOTE_START = SIMILAR_NOTE.split("(")[0]
FRANCE = "What is the capital of France?"
SIMILAR = "What is the capital city of France?"      # hash cosine 0.90 to FRANCE


@pytest.fixture(scope="module")
def server(server):
    """The package's server (tests/server/api/conftest.py) with FRANCE answered and stored."""
    ask(server, FRANCE)
    server.settle()
    return server


def test_close_paraphrase_is_semantic(server):
    layer, sim, out = ask(server, "what is the capital of France")
    assert layer == "semantic" and float(sim) >= 0.95
    assert out.model_extra["strata"]["cache"] == "semantic"
    assert not out.choices[0].message.content.startswith(NOTE_START)


def test_similar_question_carries_a_note_switchable_per_request(server):
    layer, sim, out = ask(server, SIMILAR)
    assert layer == "semantic-similar" and 0.85 <= float(sim) < 0.95
    assert out.choices[0].message.content.startswith(NOTE_START)
    _, _, plain = ask(server, SIMILAR, extra_body={"similar_note": False})
    assert not plain.choices[0].message.content.startswith(NOTE_START)
    assert plain.choices[0].message.content in out.choices[0].message.content


def test_note_switchable_per_server(server):
    settings = server.app.state.config          # --no-similar-note: off for the server, a request may opt in
    settings.similar_note = False
    try:
        assert not ask(server, SIMILAR)[2].choices[0].message.content.startswith(NOTE_START)
        opted = ask(server, SIMILAR, extra_body={"similar_note": True})[2]
        assert opted.choices[0].message.content.startswith(NOTE_START)
    finally:
        settings.similar_note = True


def test_distinct_question_misses(server):
    assert ask(server, "What is the capital of Germany?")[0] == "miss"     # hash cosine 0.80


def test_review_lists_near_threshold_hits(server):
    ask(server, SIMILAR)
    review = admin(server, "/admin/cache/review?limit=5").json()["data"]
    assert 1 <= len(review) <= 5
    assert review[0]["tier"] == "similar" and review[0]["query"] == SIMILAR and review[0]["tenant"] == "acme"
    assert review[0]["cached"] == FRANCE and 0.85 <= review[0]["similarity"] < 0.95
