"""`echo` on the completions endpoint over real HTTP with the official openai client and the real default model: the
prompt comes first in the text and, with logprobs, its tokens' logprobs first (the first one null), as
lm-evaluation-harness scores a loglikelihood (echo, logprobs=1, max_tokens=0)."""
from __future__ import annotations

import openai
import pytest
import torch
from helpers.http_server import MODEL, client
from transformers import AutoModelForCausalLM

pytestmark = [pytest.mark.http, pytest.mark.slow]

PROMPT = "The capital of France is Paris. The capital of Italy is"


def complete(server, **kwargs):
    return client(server).completions.with_raw_response.create(model=MODEL, prompt=PROMPT, temperature=0, **kwargs)


def test_echo_puts_the_prompt_first_and_bypasses_the_cache(server):
    plain = complete(server, max_tokens=4).parse().choices[0].text
    raw = complete(server, max_tokens=4, echo=True)
    assert raw.parse().choices[0].text == PROMPT + plain
    assert raw.headers["x-strata-cache"] == "bypass" and raw.parse().strata["reason"] == "echo"


def test_scoring_a_prompt_with_max_tokens_0_matches_hf(server, default_model_dir):
    for _ in range(2):          # the second time its blocks are in the prefix cache: every position is still scored
        out = complete(server, max_tokens=0, echo=True, logprobs=1).parse()
        choice = out.choices[0]
        assert choice.text == PROMPT and choice.finish_reason == "length" and out.usage.completion_tokens == 0
        lp = choice.logprobs
        ids = server.inputs.tokenizer.encode(PROMPT)
        assert len(lp.tokens) == len(ids) == out.usage.prompt_tokens and "".join(lp.tokens) == PROMPT
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
        hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            expected = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
        for pos in range(1, len(ids)):
            assert lp.token_logprobs[pos] == pytest.approx(expected[pos - 1, ids[pos]].item(), abs=1e-4)
            assert len(lp.top_logprobs[pos]) == 1


def test_echo_with_logprobs_lists_prompt_then_answer_tokens(server):
    out = complete(server, max_tokens=3, echo=True, logprobs=0, extra_body={"ignore_eos": True}).parse().choices[0]
    lp = out.logprobs
    prompt_tokens = len(server.inputs.tokenizer.encode(PROMPT))
    assert len(lp.tokens) == prompt_tokens + 3 and "".join(lp.tokens) == out.text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]


def test_echo_streams_the_prompt_first(server):
    stream = client(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True,
                                               stream=True)
    texts = [c.choices[0].text for c in stream if c.choices and c.choices[0].text]
    assert texts[0] == PROMPT and len(texts) > 1


def test_max_tokens_0_needs_echo(server):
    with pytest.raises(openai.BadRequestError) as info:
        complete(server, max_tokens=0)
    assert info.value.param == "max_tokens"
