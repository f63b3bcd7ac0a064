"""Concurrent near-duplicate drill over HTTP: a question that arrives while a similar but different one is being
computed never gets that answer (single-flight goes through the same second stage as stored entries); an identical
one does, labelled "shared"."""
from __future__ import annotations

import threading
import time

import pytest
from helpers.http_server import start_server

from strata.cache.request.request_cache import RequestCacheConfig
from strata.cache.request.semantic import SemanticCache
from strata.server.api.config import ServerConfig

pytestmark = [pytest.mark.http, pytest.mark.slow]


@pytest.fixture(scope="module")
def server(tiny_chat_engine):
    """One server for the three pairs: no question of one pair is near one of another."""
    semantic = SemanticCache.from_config(RequestCacheConfig())          # the shipped embedder and second stage
    with start_server(semantic, ServerConfig(default_max_tokens=8), engine=tiny_chat_engine) as srv:
        yield srv


@pytest.mark.parametrize("first, second, shares", [
    ("Convert 5 kg to lb.", "Convert 5 lb to kg.", False),
    ("Tell me story number 3 about the lighthouse.", "Tell me story number 4 about the lighthouse.", False),
    ("What is the boiling point of water?", "What is the boiling point of water?", True),
])
def test_a_pending_neighbour_is_followed_only_when_it_asks_the_same(server, first, second, shares):
    results = {}

    def ask(name, question, max_tokens):
        with server.http() as http:
            res = http.post("/v1/chat/completions", json={
                "model": server.model, "messages": [{"role": "user", "content": question}],
                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
        results[name] = (res.headers["x-strata-cache"], res.json()["choices"][0]["message"]["content"])

    leader = threading.Thread(target=ask, args=("first", first, 400))
    leader.start()
    deadline = time.monotonic() + 30                     # ask only once the leader is decoding (400 steps to go)
    while server.stats()["num_running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    ask("second", second, 400)
    leader.join()
    assert results["first"][0] == "miss"                 # nothing stored before by another pair served it
    layer, text = results["second"]
    if shares:
        assert layer == "shared" and text == results["first"][1]
    else:
        assert layer == "miss", (layer, results)
