"""vLLM's sampling extensions over real HTTP with the official openai client (extensions through extra_body), the
real default model, greedy decoding; and the exact cache keeping answers of different settings apart."""
from __future__ import annotations

import openai
import pytest
from helpers.http_server import MODEL, client

from strata.server.api.config import ServerConfig

pytestmark = [pytest.mark.http, pytest.mark.slow]

HI = [{"role": "user", "content": "Say hi."}]


def chat(server, max_tokens: int = 40, messages=HI, **extra_body):
    """One greedy chat answer with the request cache off (each test reads the engine, not an earlier answer)."""
    return client(server).chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                                  temperature=0, extra_body={"cache": "off"} | extra_body)


@pytest.fixture(scope="module")
def natural(server):
    """The plain answer to HI: it ends by EOS well before 40 tokens (what the tests below change)."""
    out = chat(server)
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens < 30
    return out


def test_ignore_eos_runs_to_max_tokens(server, natural):
    out = chat(server, ignore_eos=True)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 40
    assert out.choices[0].message.content.startswith(natural.choices[0].message.content)


def test_min_tokens_holds_the_end_back(server, natural):
    want = natural.usage.completion_tokens + 6
    out = chat(server, min_tokens=want)
    assert out.usage.completion_tokens >= want
    assert out.choices[0].message.content.startswith(natural.choices[0].message.content)


def test_skip_special_tokens(server, natural):
    """Past EOS (ignore_eos) the end-of-turn token is text only when skip_special_tokens is false."""
    kept = chat(server, ignore_eos=True, skip_special_tokens=False).choices[0].message.content
    skipped = chat(server, ignore_eos=True).choices[0].message.content
    assert "<|im_end|>" in kept and "<|im_end|>" not in skipped


def test_stop_token_ids_with_and_without_the_stop_text(server, natural):
    tokenizer = server.inputs.tokenizer
    text = natural.choices[0].message.content
    ids = tokenizer.encode(text, add_special_tokens=False)
    stop_id = ids[2]
    out = chat(server, stop_token_ids=[stop_id])
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == 3
    assert out.choices[0].message.content == tokenizer.decode(ids[:2])
    kept = chat(server, stop_token_ids=[stop_id], include_stop_str_in_output=True)
    assert kept.choices[0].message.content == tokenizer.decode(ids[:3])


def test_stop_string_with_and_without_the_stop_text(server, natural):
    text = natural.choices[0].message.content
    word = text.split()[1]
    cut = chat(server, stop=[word])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].message.content == text[:text.index(word)]
    kept = chat(server, stop=[word], include_stop_str_in_output=True)
    assert kept.choices[0].message.content == text[:text.index(word) + len(word)]


def test_max_completion_tokens_is_max_tokens_for_chat(server):
    out = client(server).chat.completions.create(model=MODEL, messages=HI, max_completion_tokens=3, temperature=0,
                                                 extra_body={"cache": "off", "ignore_eos": True})
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"


def test_sixteen_stops_accepted_seventeen_refused(server):
    stops = [f"zz{i}" for i in range(17)]
    assert chat(server, max_tokens=4, stop=stops[:16]).choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError) as info:
        chat(server, max_tokens=4, stop=stops)
    assert info.value.param == "stop"


def test_penalties_change_the_answer(server, natural):
    """A strong repetition penalty on the chat template's own tokens moves the greedy answer off its usual path."""
    out = chat(server, repetition_penalty=2.0, presence_penalty=1.5, frequency_penalty=1.5)
    assert out.choices[0].message.content != natural.choices[0].message.content


@pytest.mark.parametrize("extra,param", [
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"min_tokens": 41}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"stop_token_ids": [10**7]}, "stop_token_ids"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids.0"),
    ({"stop_token_ids": [5] * 1025}, "stop_token_ids"),           # each is checked against every sampled token
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"repetition_penalty": 1e-38}, "repetition_penalty"),        # overflowed the logits: one special token repeated
    ({"frequency_penalty": "1"}, "frequency_penalty"),             # a number as text is refused, as OpenAI does
    ({"temperature": "0.5"}, "temperature"),
    ({"top_p": True}, "top_p"),
])
def test_out_of_range_settings_are_refused_by_name(server, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        chat(server, **extra)
    assert info.value.param == param


def cached(server, question: str, **extra) -> str:
    """The cache layer that answered a greedy chat request."""
    raw = client(server).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=8, temperature=0,
        extra_body=extra)
    server.settle()
    return raw.headers["x-strata-cache"]


def test_settings_that_change_the_answer_are_in_the_cache_key(server):
    question = "Name a large ocean."
    assert cached(server, question) == "miss"
    for setting in ({"repetition_penalty": 1.2}, {"presence_penalty": 0.5}, {"frequency_penalty": 0.5},
                    {"min_tokens": 4}, {"ignore_eos": True}, {"stop_token_ids": [13]},
                    {"skip_special_tokens": False}, {"include_stop_str_in_output": True}):
        assert cached(server, question, **setting) == "miss", setting
        assert cached(server, question, **setting) == "exact", setting


def test_settings_that_do_not_change_the_answer_still_hit(server):
    question = "Name a tall mountain."
    assert cached(server, question) == "miss"
    assert cached(server, question, user="someone-else") == "exact"
    assert cached(server, question, repetition_penalty=1.0, presence_penalty=0, min_tokens=0,
                  ignore_eos=False, skip_special_tokens=True, stop_token_ids=[]) == "exact"
    assert cached(server, question, seed=7, top_p=0.5) == "exact"      # greedy never reads them


def test_the_length_limit_an_answer_was_made_under_is_in_its_key(server):
    """A request without max_tokens is keyed at the limit it runs under (the server's --default-max-tokens), so an
    answer cut at another default (before a restart with a larger one) is never served for it."""
    question = [{"role": "user", "content": "Name a long river."}]

    def layer(**limit) -> str:
        raw = client(server).chat.completions.with_raw_response.create(model=MODEL, messages=question, temperature=0,
                                                                       **limit)
        server.settle()
        return raw.headers["x-strata-cache"]

    assert layer(max_tokens=ServerConfig().default_max_tokens) == "miss"     # the fixture's server runs the default
    assert layer() == "exact"                   # the same limit, named or not
    assert layer(max_tokens=5) == "miss"



def test_null_for_a_nullable_openai_setting_means_its_default(server, natural):
    """OpenAI types temperature, top_p, n, stream and the penalties `X | null`, and its client sends null for an
    argument given as None (audit 11: each was a 400 here)."""
    out = client(server).chat.completions.create(
        model=MODEL, messages=HI, max_tokens=40, temperature=None, top_p=None, n=None, presence_penalty=None,
        frequency_penalty=None, extra_body={"cache": "off", "stream": None})
    assert len(out.choices) == 1 and out.usage.completion_tokens > 0
    greedy = client(server).chat.completions.create(model=MODEL, messages=HI, max_tokens=40, temperature=0,
                                                    top_p=None, presence_penalty=None, extra_body={"cache": "off"})
    assert greedy.choices[0].message.content == natural.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as info:           # a required field stays required
        client(server).chat.completions.create(model=MODEL, messages=None, max_tokens=4)
    assert info.value.param == "messages"
