"""Speculative decoding over HTTP: a miss carries the answers of close cached questions as drafts (--speculative
cache), the response says what drafts did (X-Strata-Spec, body `strata.spec`), /metrics counts them per source, and
the answer is the one plain decoding gives."""
from __future__ import annotations

import dataclasses

import pytest
from helpers.http_server import ENGINE, MODEL, admin, client, hash_semantic, start_server

pytestmark = [pytest.mark.http, pytest.mark.slow]

CACHED = "What is the capital of France? Answer in one sentence."
ASKED = "What is the capital of France? Answer in two sentences."     # hash cosine < 0.85: computed, not served


@pytest.fixture(scope="module")
def server():
    with start_server(hash_semantic(), engine=dataclasses.replace(ENGINE, speculative="ngram+cache")) as srv:
        yield srv


def ask(server, question: str, **extra):
    raw = client(server).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=24, temperature=0, **extra)
    return raw.headers, raw.parse()


def test_a_miss_verifies_close_cached_answers_as_drafts_and_says_so(server):
    ask(server, CACHED)
    server.settle()
    headers, out = ask(server, ASKED)
    assert headers["x-strata-cache"] == "miss"
    spec = out.model_extra["strata"]["spec"]
    assert spec["cache"]["drafts"] >= 1 and spec["cache"]["proposed_tokens"] >= 1
    assert f"drafts={spec['cache']['drafts']}" in headers["x-strata-spec"]
    _, plain = ask(server, ASKED, extra_body={"cache": "off"})       # no lookup: no cache drafts
    assert "cache" not in (plain.model_extra["strata"].get("spec") or {})
    assert plain.choices[0].message.content == out.choices[0].message.content
    metrics = admin(server, "/metrics").text
    line = next(m for m in metrics.splitlines() if m.startswith('strata_spec_drafts_total{source="cache"}'))
    assert float(line.split()[-1]) >= 1
