"""Key normalization and composition: same question -> same key, anything that changes the answer -> another key."""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from strata.cache.request.keys import NotCacheable, build_key, sampling_key
from strata.cache.request.normalize import normalize_text
from strata.cache.request.request import CacheRequest


def req(text="What is the capital of France?", *, tenant="default", model="m@1", system=None, history=(), **sampling):
    messages = ([{"role": "system", "content": system}] if system else []) + list(history) + \
        [{"role": "user", "content": text}]
    return CacheRequest(tenant, model, messages, sampling or {"temperature": 0})


def test_normalize_width_whitespace_newlines():
    assert normalize_text("ＡＢＣ１２３，ｈｅｌｌｏ") == "ABC123,hello"
    assert normalize_text("  a \t b\u3000c  ") == "a b c"
    assert normalize_text("a\r\nb\rc") == "a\nb\nc"
    assert normalize_text("a\n\n\n\n b") == "a\n\nb"
    assert normalize_text("Paris", casefold=True) == "paris"
    assert normalize_text("Paris") == "Paris"
    with pytest.raises(ValueError):
        normalize_text(None)


@given(st.text())
def test_normalize_is_idempotent(text):
    once = normalize_text(text, casefold=True)
    assert normalize_text(once, casefold=True) == once


@given(st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=40))
def test_full_width_and_extra_spaces_share_the_key(text):
    full_width = "".join(chr(ord(c) + 0xFEE0) for c in text)      # U+FF01..U+FF5E
    assert build_key(req(text)).exact == build_key(req(f"  {full_width} \r\n")).exact


def test_same_question_typed_differently_shares_key():
    a = build_key(req("What is the capital of France?"))
    b = build_key(req("  What is the capital\tof France？ "))   # full-width question mark, extra spaces
    assert a.exact == b.exact
    assert build_key(req("what is the capital of france?"), casefold=True).exact == \
        build_key(req("What Is The Capital Of France?"), casefold=True).exact
    assert build_key(req("what is the capital of france?")).exact != a.exact   # no folding by default


def test_everything_that_changes_the_answer_changes_the_key():
    base = build_key(req()).exact
    variants = [
        req(tenant="other"), req(model="m@2"), req(system="Answer in French."),
        req(history=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]),
        req(temperature=0, max_tokens=10), req(temperature=0, top_p=0.5), req(temperature=0, stop=["\n"]),
        req(temperature=0, tools=[{"type": "function", "function": {"name": "f"}}]),
        req(temperature=0, response_format={"type": "json_object"}),
        req("What is the capital of Spain?"),
    ]
    keys = {build_key(v).exact for v in variants}
    assert base not in keys and len(keys) == len(variants)


def test_sampling_is_sorted_and_canonical():
    assert sampling_key({"top_p": 1, "temperature": 0}) == sampling_key({"temperature": 0.0, "top_p": 1.0})
    assert sampling_key({"stop": "x"}) == sampling_key({"stop": ["x"]})
    assert sampling_key({"stream": True, "user": "u1", "seed": None}) == sampling_key({})
    with pytest.raises(ValueError, match="not JSON"):
        sampling_key({"temperature": object()})


def test_partition_layout_and_personal_templating():
    key = build_key(req("My email is bob@example.com, write a greeting"))
    tenant, model, *hashes = key.partition.split("|")
    assert (tenant, model, len(hashes)) == ("default", "m@1", 3)
    assert key.personal and "bob@example.com" not in key.text
    other = build_key(req("My email is amy@example.org, write a greeting"))
    assert other.exact == key.exact and other.flight != key.flight   # one entry, two separate computations


@pytest.mark.parametrize("bad", [
    dict(tenant=""), dict(tenant="a|b"), dict(model=""), dict(messages=[]), dict(messages=[{"role": "x", "content": "a"}]),
    dict(messages=[{"role": "user", "content": 3}]), dict(sampling=[]), dict(mode="fast"),
])
def test_bad_requests_raise_value_error(bad):
    fields = dict(tenant="t", model="m", messages=[{"role": "user", "content": "hi"}], sampling={})
    with pytest.raises(ValueError):
        CacheRequest(**(fields | bad))


def test_uncacheable_shapes():
    with pytest.raises(NotCacheable, match="not-a-user-turn"):
        build_key(CacheRequest("t", "m", [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]))
    with pytest.raises(NotCacheable, match="non-text-content"):
        build_key(CacheRequest("t", "m", [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]))
    with pytest.raises(NotCacheable, match="empty-query"):
        build_key(CacheRequest("t", "m", [{"role": "user", "content": "   "}]))
    parts = CacheRequest("t", "m", [{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert build_key(parts).query == "hi"
