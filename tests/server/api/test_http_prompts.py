"""The completions endpoint's prompt forms over real HTTP with the official openai client and the real default model:
several prompts in one request (one choice each, in order, usage summed, streamed too), token-id prompts, and the
400s that name `prompt`."""
from __future__ import annotations

import openai
import pytest
from helpers.http_server import MODEL, client

pytestmark = [pytest.mark.http, pytest.mark.slow]

PROMPTS = ["The quick brown fox", "Roses are red,"]


def complete(server, prompt, **kwargs):
    return client(server).completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=5,
                                                               temperature=0, **kwargs)


@pytest.fixture(scope="module")
def alone(server):
    """Each prompt's answer, asked alone."""
    return [complete(server, p, extra_body={"cache": "off"}).parse() for p in PROMPTS]


def test_a_list_of_prompts_gets_one_choice_each_in_order(server, alone):
    raw = complete(server, PROMPTS, extra_body={"cache": "off"})
    out = raw.parse()
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [a.choices[0].text for a in alone]
    assert out.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert out.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert raw.headers["x-strata-cache"] == "bypass, bypass" and len(out.strata) == 2


def test_token_id_prompts_answer_as_their_text_and_bypass_the_cache(server, alone):
    ids = [server.inputs.tokenizer.encode(p) for p in PROMPTS]
    one = complete(server, ids[0])
    assert one.headers["x-strata-cache"] == "bypass" and one.parse().strata["reason"] == "token-ids"
    assert one.parse().choices[0].text == alone[0].choices[0].text
    both = complete(server, ids).parse()
    assert [c.text for c in both.choices] == [a.choices[0].text for a in alone]


def test_several_prompts_stream_each_choice_by_index(server, alone):
    stream = client(server).completions.create(model=MODEL, prompt=PROMPTS, max_tokens=5, temperature=0, stream=True,
                                               stream_options={"include_usage": True},
                                               extra_body={"cache": "off"})
    texts, finished, usage = ["", ""], [None, None], None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            finished[choice.index] = choice.finish_reason or finished[choice.index]
    assert texts == [a.choices[0].text for a in alone]
    assert finished == [a.choices[0].finish_reason for a in alone]
    assert usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)


def test_a_prompt_repeated_in_one_request_is_answered_at_once_and_cached_once(server):
    """The second copy once waited for the first's single-flight, which could only start after both were looked up:
    the request hung until the follow timeout, and every later request for that question with it."""
    prompt = "Twice in one request: name a colour."
    raw = complete(server, [prompt, prompt], timeout=30)
    out = raw.parse()
    assert out.choices[0].text == out.choices[1].text                  # greedy: the same answer, computed twice
    assert raw.headers["x-strata-cache"] == "miss, bypass" and out.strata[1]["reason"] == "repeat-in-request"
    server.settle()
    again = complete(server, prompt, timeout=30)
    assert again.headers["x-strata-cache"] == "exact" and again.parse().choices[0].text == out.choices[0].text


def test_a_prompt_differing_only_in_whitespace_is_its_own_entry(server):
    """Audit: 'def add_X(a, b):' + newline was served the answer cached for the prompt without it (exact), though
    the model continues them differently; a completion prompt is keyed on its exact characters."""
    for first, second in [("def add_7(a, b):", "def add_7(a, b):\n"), ("Line one Z\r\nLine two", "Line one Z\nLine two"),
                          ("Q: 2+2=  A:", "Q: 2+2= A:")]:
        assert complete(server, first).headers["x-strata-cache"] == "miss"
        server.settle()
        assert complete(server, first).headers["x-strata-cache"] == "exact"
        other = complete(server, second)
        assert other.headers["x-strata-cache"] == "miss", (first, second)
        assert other.parse().choices[0].text == complete(server, second, extra_body={"cache": "off"}).parse() \
            .choices[0].text


def test_logprobs_come_per_choice(server):
    out = complete(server, PROMPTS, logprobs=1).parse()
    assert all("".join(c.logprobs.tokens) == c.text and len(c.logprobs.tokens) == 5 for c in out.choices)


@pytest.mark.parametrize("prompt", [[], [[]], [1, "a"], [10**9], [[1, 2], [10**9]], ["a", ""]])
def test_bad_prompts_are_400s_naming_prompt(server, prompt):
    with pytest.raises(openai.BadRequestError) as info:
        complete(server, prompt)
    assert info.value.param == "prompt"
    assert server.idle_blocks(server.idle) == server.idle        # nothing of the good prompts is left running
