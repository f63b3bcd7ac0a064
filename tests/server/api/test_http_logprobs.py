"""Logprobs over real HTTP with the official openai client and the real default model (fp32): chat's shape, the
completions endpoint's legacy shape, streaming, agreement with HF transformers' log-softmax, and the response cache
never read nor written for such requests."""
from __future__ import annotations

import openai
import pytest
import torch
from helpers.http_server import MODEL, client
from transformers import AutoModelForCausalLM

from strata.server.api.logprobs import LogprobsFormat
from strata.server.engine.logprobs import TokenLogprob

pytestmark = [pytest.mark.http, pytest.mark.slow]

HI = [{"role": "user", "content": "Say hi."}]
FOX = "The quick brown fox"


def chat(server, **kwargs):
    return client(server).chat.completions.with_raw_response.create(
        model=MODEL, messages=HI, max_tokens=8, temperature=0, **kwargs)


def test_chat_logprobs_have_openai_shape_and_greedy_takes_the_top_token(server):
    raw = chat(server, logprobs=True, top_logprobs=3)
    out = raw.parse()
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and bytes(entry.bytes).decode() == entry.token
        assert len(entry.top_logprobs) == 3
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
    assert out.choices[0].message.content.startswith("".join(e.token for e in content[:3]))
    without_top = chat(server, logprobs=True).parse().choices[0].logprobs.content
    assert [e.token for e in without_top] == [e.token for e in content] and all(not e.top_logprobs for e in without_top)
    assert chat(server).parse().choices[0].logprobs is None


def test_streamed_chat_logprobs_are_the_same_tokens(server):
    whole = chat(server, logprobs=True, top_logprobs=2).parse().choices[0]
    stream = client(server).chat.completions.create(model=MODEL, messages=HI, max_tokens=8, temperature=0,
                                                    logprobs=True, top_logprobs=2, stream=True)
    streamed, text = [], ""
    for chunk in stream:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
            text += chunk.choices[0].delta.content or ""
    assert text == whole.message.content
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in whole.logprobs.content]


def test_completion_logprobs_match_hf_log_softmax(server, default_model_dir):
    out = client(server).completions.create(model=MODEL, prompt=FOX, max_tokens=6, temperature=0, logprobs=2,
                                            extra_body={"ignore_eos": True})
    choice = out.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(6)]
    tokenizer = server.inputs.tokenizer
    prompt = tokenizer.encode(FOX)
    generated = tokenizer.encode(choice.text, add_special_tokens=False)
    assert [tokenizer.decode([t]) for t in generated] == lp.tokens      # the ids the server generated
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1:-1].float()
    expected = torch.log_softmax(logits, dim=-1)
    for pos, token in enumerate(generated):
        assert lp.token_logprobs[pos] == pytest.approx(expected[pos, token].item(), abs=1e-4)
        top_values, top_ids = expected[pos].topk(2)
        assert lp.top_logprobs[pos] == pytest.approx(
            {tokenizer.decode([t]): v for t, v in zip(top_ids.tolist(), top_values.tolist(), strict=True)}, abs=1e-4)


EMOJI = "Party emoji: \U0001f389\U0001f389 and \U0001f469 ok"    # each emoji is 3 byte-level tokens here


def test_tokens_inside_a_character_keep_their_bytes_offsets_and_alternatives(server):
    """Byte-level tokens that are part of a multi-byte character: their own bytes (joined, the text), a text that
    tells them apart (`bytes:\\x..`), offsets inside the text, and every alternative in the completions dict (all
    read U+FFFD alone, so the dict kept one, with the least likely one's logprob)."""
    out = client(server).completions.create(model=MODEL, prompt=EMOJI, max_tokens=0, echo=True, logprobs=5)
    lp = out.choices[0].logprobs
    assert out.choices[0].text == EMOJI
    partial = [t for t in lp.tokens if t.startswith("bytes:")]
    assert len(partial) >= 6 and len(set(lp.tokens)) < len(lp.tokens)     # the emoji's pieces, the repeated ones
    assert all(len(top) == 5 for top in lp.top_logprobs[1:])
    starts = [lp.text_offset[i] for i, t in enumerate(lp.tokens) if not t.startswith("bytes:")]
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] < len(EMOJI)
    assert all(EMOJI[o:].startswith(t) for o, t in zip(starts, (t for t in lp.tokens if not t.startswith("bytes:")),
                                                       strict=True))
    assert EMOJI[lp.text_offset[lp.tokens.index("bytes:\\x8e")]] == "\U0001f389"   # the emoji's 2nd piece

    tokenizer = server.inputs.tokenizer
    ids = tokenizer.encode(EMOJI, add_special_tokens=False)
    content = LogprobsFormat(tokenizer, chat=True)([TokenLogprob(t, -1.0, ((t, -1.0),)) for t in ids])["content"]
    assert bytes(b for entry in content for b in entry["bytes"]).decode() == EMOJI
    assert [entry["token"] for entry in content] == [entry["top_logprobs"][0]["token"] for entry in content]
    assert {"bytes:\\xf0\\x9f", "bytes:\\x8e", " ok"} <= {entry["token"] for entry in content}


def test_logprobs_requests_neither_read_nor_write_the_response_cache(server):
    messages = [{"role": "user", "content": "Name a fruit."}]

    def ask(**kwargs):
        raw = client(server).chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=4,
                                                                       temperature=0, **kwargs)
        return raw.headers["x-strata-cache"], raw.parse()

    for _ in range(2):
        layer, out = ask(logprobs=True)
        assert layer == "bypass" and out.strata["reason"] == "logprobs"
        server.settle()
    assert ask()[0] == "miss"                  # nothing was written by the logprobs requests
    server.settle()
    assert ask()[0] == "exact"
    layer, out = ask(logprobs=True)            # an entry exists, and is not read
    assert layer == "bypass" and out.choices[0].logprobs.content


@pytest.mark.parametrize("kwargs,param", [({"top_logprobs": 2}, "top_logprobs"),
                                          ({"logprobs": True, "top_logprobs": 21}, "top_logprobs")])
def test_bad_logprobs_settings_are_named(server, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        chat(server, **kwargs)
    assert info.value.param == param
