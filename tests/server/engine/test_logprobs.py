"""Logprobs of sampled tokens: the log-softmax of the model's raw fp32 logits, checked against HF transformers'
forward over the same prompt and tokens, and unaffected by sampling settings or by batch neighbours that did not ask."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from strata.server.engine.config import EngineConfig
from strata.server.engine.llm_engine import LLMEngine
from strata.server.engine.logprobs import token_logprobs
from strata.server.engine.sampler import RowError
from strata.server.engine.sampling_params import InvalidParam, SamplingParams
from strata.server.engine.sequence import Sequence

NEW_TOKENS = 6


def test_only_rows_that_asked_get_logprobs_and_the_top_k_is_sorted():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 0.0], [4.0, 1.0, 1.0, 1.0]])
    seqs = [Sequence("a", [1], SamplingParams(logprobs=2)), Sequence("b", [1], SamplingParams()),
            Sequence("c", [1], SamplingParams(logprobs=0))]
    out = token_logprobs(logits, seqs, [2, 2, 0])
    expected = torch.log_softmax(logits, dim=-1)
    assert out[1] is None
    assert out[0].token_id == 2 and out[0].logprob == pytest.approx(expected[0, 2].item())
    assert [t for t, _ in out[0].top] == [1, 2] and out[0].top[0][1] == pytest.approx(expected[0, 1].item())
    assert out[2].top == () and out[2].logprob == pytest.approx(expected[2, 0].item())


def test_a_row_that_failed_sampling_gets_none():
    seqs = [Sequence("a", [1], SamplingParams(logprobs=1))]
    assert token_logprobs(torch.zeros(1, 4), seqs, [RowError("broken")]) == [None]


@pytest.mark.parametrize("bad", [-1, 21, True, 1.5])
def test_logprobs_outside_0_to_20_are_refused(bad):
    with pytest.raises(InvalidParam) as err:
        SamplingParams(logprobs=bad)
    assert err.value.param == "logprobs"


@pytest.mark.slow
def test_logprobs_equal_hf_log_softmax_of_fp32_logits(default_model_dir):
    engine = LLMEngine(EngineConfig(model=str(default_model_dir), dtype="fp32", kv_cache_memory="256MiB"))
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    prompts = [engine.inputs.encode("Name a color.", chat=True), engine.inputs.encode("The quick brown fox")]
    # sampled with a temperature and penalties: the logprobs stay the raw model's
    asked = SamplingParams(temperature=0.8, seed=3, repetition_penalty=1.3, max_tokens=NEW_TOKENS, ignore_eos=True,
                           logprobs=5)
    plain = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts + prompts, [asked, asked, plain, plain], strict=True)]
    tokens, logprobs = {i: [] for i in ids}, {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            logprobs[out.request_id] += out.new_logprobs
    for prompt, i in zip(prompts, ids[:2], strict=True):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + tokens[i]])).logits[0, len(prompt) - 1:-1].float()
        expected = torch.log_softmax(logits, dim=-1)
        assert len(tokens[i]) == NEW_TOKENS and [entry.token_id for entry in logprobs[i]] == tokens[i]
        for pos, (entry, token) in enumerate(zip(logprobs[i], tokens[i], strict=True)):
            assert entry.logprob == pytest.approx(expected[pos, token].item(), abs=1e-4)
            top_values, top_ids = expected[pos].topk(5)
            assert [t for t, _ in entry.top] == top_ids.tolist()
            assert [v for _, v in entry.top] == pytest.approx(top_values.tolist(), abs=1e-4)
    assert all(logprobs[i] == [] and len(tokens[i]) == NEW_TOKENS for i in ids[2:])


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [16, 2048])     # prefill in chunks of 16 tokens, or whole
def test_prompt_logprobs_equal_hf_and_skip_the_prefix_cache(default_model_dir, chunk):
    engine = LLMEngine(EngineConfig(model=str(default_model_dir), dtype="fp32", kv_cache_memory="256MiB",
                                    max_num_batched_tokens=chunk, max_num_seqs=4))
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    prompt = engine.inputs.encode("The capital of France is Paris. The capital of Italy is Rome. The capital of "
                                  "Spain is Madrid. The capital of Germany is Berlin. The capital of Japan is")
    assert len(prompt) > 2 * engine.config.block_size
    engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1))      # its blocks are now cached
    seq = engine.inputs.make_sequence(prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))
    engine.enqueue(seq)
    first = None
    while engine.has_unfinished():
        for out in engine.step():
            first = first or out
    assert first.num_cached_tokens == 0 and first.prompt_logprobs is not None
    entries = first.prompt_logprobs
    with torch.no_grad():
        expected = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
    assert [e.token_id for e in entries] == prompt and entries[0].logprob is None
    for pos in range(1, len(prompt)):
        assert entries[pos].logprob == pytest.approx(expected[pos - 1, prompt[pos]].item(), abs=1e-4)
        assert [t for t, _ in entries[pos].top] == expected[pos - 1].topk(3).indices.tolist()


def test_a_logprobs_fault_on_one_request_fails_that_request_only(tiny_model_dirs, monkeypatch):
    """Logprobs are computed inside the step's retry: one request's fault there leaves the others' tokens as they
    would have been."""
    from strata.server.engine import model_runner

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dirs["tiny-llama"]), dtype="fp32", kv_cache_memory="8MiB",
                                    block_size=8))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    reference = engine.generate([[5, 6, 7]], params)[0]
    real_fill = model_runner.fill_prompt_logprobs

    def fill_unless_poisoned(logits, seq, start):
        if seq.request_id == "poisoned":
            raise RuntimeError("simulated logprobs fault")
        real_fill(logits, seq, start)

    monkeypatch.setattr(model_runner, "fill_prompt_logprobs", fill_unless_poisoned)
    good = engine.add_request([5, 6, 7], params)
    engine.add_request([9, 10, 11, 12], params, request_id="poisoned")
    done, first = {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            first.setdefault(out.request_id, out)
            if out.finished:
                done[out.request_id] = out
    assert done["poisoned"].finish_reason == "error" and done["poisoned"].token_ids == []
    assert done[good].token_ids == reference.token_ids and len(first[good].prompt_logprobs) == 3
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
