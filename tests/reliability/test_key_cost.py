"""Keying a request (normalization, PII templating, policy rules) runs on the event loop, so its cost must grow
linearly with the text: one 50,000-character message of a repeated shape must not stall every other request.
Each shape here took 1 s to minutes before (a regex rescanning from every position); now tens of milliseconds."""
import time

import pytest

from strata.cache.request.keys import build_key
from strata.cache.request.pii import has_pii
from strata.cache.request.policy import Policy
from strata.cache.request.request import CacheRequest

SHAPES = ["`", "``a", "1", "1,", "1元", "$1", "中", "x", "a@", "x@x.", "1-", "2024-", "+1", "é", "my name is A ",
          "what is ", "还有", "transfer ", "' ", '"', "a \t", "中？", "a  \n"]


@pytest.fixture(scope="module")
def policy():
    return Policy.load()


@pytest.mark.parametrize("shape", SHAPES)
def test_keying_a_long_repetitive_message_costs_linear_time(policy, shape):
    text = shape * (50_000 // len(shape))
    req = CacheRequest("t", "m", [{"role": "user", "content": text}], {"temperature": 0})
    start = time.perf_counter()
    policy.decide(req, build_key(req))
    has_pii(text)                                   # the writer checks the answer the same way
    assert time.perf_counter() - start < 2.0        # ~0.01-0.2 s here; the quadratic versions took 1 s to minutes
