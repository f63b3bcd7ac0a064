"""`n` samples per prompt over real HTTP with the official openai client and the real default model: n choices in
order, each its own sample (seeded: reproducible), and the later samples reuse the first one's prompt blocks through
the prefix cache."""
from __future__ import annotations

import openai
import pytest
from helpers.http_server import MODEL, client

pytestmark = [pytest.mark.http, pytest.mark.slow]

HI = [{"role": "user", "content": "Tell me a word."}]


def chat(server, **kwargs):
    return client(server).chat.completions.with_raw_response.create(model=MODEL, messages=HI, max_tokens=6, seed=7,
                                                                    temperature=1.0, **kwargs)


def test_n_samples_are_choices_in_order_reproducible_with_a_seed(server):
    raw = chat(server, n=3, extra_body={"ignore_eos": True})
    out = raw.parse()
    assert [c.index for c in out.choices] == [0, 1, 2] and out.usage.completion_tokens == 18
    texts = [c.message.content for c in out.choices]
    assert len(set(texts)) > 1                                    # seed + j: the samples differ
    assert texts[0] == chat(server, extra_body={"ignore_eos": True}).parse().choices[0].message.content
    assert [c.message.content for c in chat(server, n=3, extra_body={"ignore_eos": True}).parse().choices] == texts
    assert raw.headers["x-strata-cache"] == "bypass, bypass, bypass" and out.strata[0]["reason"] == "n>1"
    one = chat(server, extra_body={"ignore_eos": True}).parse()
    assert out.usage.prompt_tokens == one.usage.prompt_tokens                 # n multiplies completion tokens only
    prompts = ["Name a colour:", "Name a fruit that is yellow:"]
    two = client(server).completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=2, temperature=1.0)
    assert two.usage.prompt_tokens == sum(len(server.inputs.tokenizer.encode(p)) for p in prompts)


def test_later_samples_reuse_the_prompt_blocks_of_the_first(server):
    prompt = ("Here is a list of animals that live on farms in many countries: cows, sheep, goats, pigs, chickens, "
              "ducks, geese, horses, donkeys, rabbits and turkeys. Name one more:")
    tokens = len(server.inputs.tokenizer.encode(prompt))
    shared = (tokens - 1) // 16 * 16       # whole 16-token blocks before the last prompt token
    assert shared >= 32
    before = server.stats()["prefix_cache_hit_tokens"]
    out = client(server).completions.create(model=MODEL, prompt=prompt, n=4, max_tokens=3, temperature=1.0,
                                            extra_body={"ignore_eos": True})
    assert len(out.choices) == 4 and out.usage.prompt_tokens == tokens      # the prompt counted once (OpenAI, vLLM)
    assert server.stats()["prefix_cache_hit_tokens"] - before == 3 * shared
    assert out.usage.prompt_tokens_details.cached_tokens == 0               # as its first sample computed it


def test_n_times_prompts_is_bounded(server):
    with pytest.raises(openai.BadRequestError) as info:
        client(server).completions.create(model=MODEL, prompt=["a"] * 8, n=9, max_tokens=1)
    assert info.value.param == "n"
