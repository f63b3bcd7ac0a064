"""The sampler never crashes on extreme settings, and a request that cannot be sampled fails alone."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.server.engine.sampler import RowError, row_argmax, sample
from strata.server.engine.sampling_params import SamplingParams
from strata.server.engine.sequence import Sequence


def seqs_for(*params: SamplingParams) -> list[Sequence]:
    return [Sequence(f"r{i}", [1, 2, 3], p) for i, p in enumerate(params)]


def test_tiny_temperature_and_top_p_never_give_nan():
    """temperature 1e-45 overflowed fp32 logits to inf (softmax NaN, multinomial raised); top_p 1e-300 is 0 in fp32
    and dropped every token. Both now sample the argmax."""
    logits = torch.randn(4, 50) * 30
    params = [SamplingParams(temperature=1e-45), SamplingParams(temperature=1e-30, top_p=1e-300),
              SamplingParams(temperature=1.0, top_p=1e-300), SamplingParams(temperature=2.0, top_k=1)]
    tokens = sample(logits, seqs_for(*params))
    assert tokens == logits.argmax(dim=-1).tolist()


@settings(max_examples=200, deadline=None)
@given(temperature=st.one_of(st.just(0.0), st.floats(1e-45, 2.0)), top_p=st.floats(1e-300, 1.0),
       top_k=st.integers(0, 80), scale=st.floats(1e-3, 1e4), seed=st.integers(0, 2**32))
def test_any_valid_setting_samples_a_token_the_filters_allow(temperature, top_p, top_k, scale, seed):
    torch.manual_seed(seed)
    logits = torch.randn(1, 64) * scale
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    (token,) = sample(logits, seqs_for(params))
    assert isinstance(token, int) and 0 <= token < 64
    if top_k:
        assert token in logits[0].topk(min(top_k, 64)).indices.tolist()


def test_sampling_keeps_the_distribution_at_ordinary_settings():
    """A chi-square check that log-space sampling is still softmax(logits / T) restricted by top-k."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -5.0]])
    params = SamplingParams(temperature=0.7, top_k=4, seed=3)
    seq = seqs_for(params)
    counts = torch.zeros(6)
    for _ in range(4000):
        counts[sample(logits, seq)[0]] += 1
    expected = torch.softmax(logits[0, :4] / 0.7, dim=-1) * 4000
    assert counts[4:].sum() == 0
    chi2 = float(((counts[:4] - expected) ** 2 / expected).sum())
    assert chi2 < 16.3          # 3 degrees of freedom, p = 0.001


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.lists(st.sampled_from([0.0, 1.0, -1.0, 3.5, math.inf, -math.inf, math.nan]), min_size=1,
                              max_size=9), min_size=1, max_size=4).filter(lambda r: len({len(x) for x in r}) == 1))
def test_row_argmax_picks_what_torch_argmax_picks_ties_nan_and_inf_included(rows):
    """numpy's argmax stands in for torch's on CPU (10x faster over a vocabulary): the same index in every case the
    sampler's checks rely on (first of ties, NaN as the maximum, an all -inf row at 0)."""
    logits = torch.tensor(rows, dtype=torch.float32)
    assert row_argmax(logits).tolist() == logits.argmax(dim=-1).tolist()
    wide = torch.randn(3, 49152)
    assert row_argmax(wide).tolist() == wide.argmax(dim=-1).tolist()


def test_a_non_finite_row_fails_alone():
    logits = torch.randn(3, 20)
    logits[1, 7] = float("nan")
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=1),
              SamplingParams(temperature=0.8, seed=2)]
    tokens = sample(logits, seqs_for(*params))
    assert isinstance(tokens[1], RowError) and "non-finite" in tokens[1]
    assert tokens[0] == int(logits[0].argmax()) and isinstance(tokens[2], int)


def test_an_all_greedy_batch_fails_its_broken_rows_alone():
    """All-greedy batches take the one-pass argmax path; rows with NaN, +inf or nothing but -inf must still fail
    alone, with the same errors as the full checks give."""
    logits = torch.randn(5, 30)
    logits[1, 3] = float("nan")
    logits[2, 9] = float("inf")
    logits[3] = float("-inf")
    tokens = sample(logits, seqs_for(*[SamplingParams(temperature=0.0)] * 5))
    assert [type(t) for t in tokens] == [int, RowError, RowError, RowError, int]
    assert "non-finite" in tokens[1] and "non-finite" in tokens[2] and "no token" in tokens[3]
    assert tokens[0] == int(logits[0].argmax()) and tokens[4] == int(logits[4].argmax())
    healthy = torch.randn(4, 30)
    assert sample(healthy, seqs_for(*[SamplingParams(temperature=0.0)] * 4)) == healthy.argmax(dim=-1).tolist()


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=math.nan), "temperature"), (dict(temperature=math.inf), "temperature"),
    (dict(top_p=math.nan), "top_p"), (dict(seed=2**64), "seed"), (dict(seed=-(2**63) - 1), "seed"),
    (dict(top_k=1.5), "top_k"),
])
def test_params_outside_what_the_sampler_takes_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1


def test_a_step_that_fails_on_one_request_fails_that_request_only(tiny_model_dirs, monkeypatch):
    """A model call that raises is retried request by request: the one that fails alone ends with "error", the
    others produce exactly the tokens they would have, and the engine keeps serving."""
    from strata.server.engine.config import EngineConfig
    from strata.server.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dirs["tiny-llama"]), dtype="fp32", kv_cache_memory="8MiB",
                                    block_size=8))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    reference = engine.generate([[5, 6, 7], [9, 10, 11, 12]], params)
    real_run = engine.runner.run

    def run_unless_poisoned(batch):
        ids = {seq.request_id for seq, _ in batch.prefills} | {seq.request_id for seq in batch.decodes}
        if "poisoned" in ids and len(engine.requests["poisoned"].output_token_ids) >= 2:
            raise RuntimeError("simulated kernel fault at /secret/path.py")
        return real_run(batch)

    monkeypatch.setattr(engine.runner, "run", run_unless_poisoned)
    good = engine.add_request([5, 6, 7], params)
    engine.add_request([9, 10, 11, 12], params, request_id="poisoned")
    done = run_to_completion(engine)
    assert done["poisoned"].finish_reason == "error" and len(done["poisoned"].token_ids) == 2
    assert "RuntimeError" in done["poisoned"].error and "/secret" not in done["poisoned"].error
    assert done[good].finish_reason == "length" and done[good].token_ids == reference[0].token_ids
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    again = engine.generate([[9, 10, 11, 12]], params)[0]      # still serving, and serves the same tokens
    assert again.token_ids == reference[1].token_ids


def test_a_sampler_fault_on_one_request_fails_that_request_only(tiny_model_dirs, monkeypatch):
    """Sampling runs after the model call advanced the batch: a sampler that raises must leave every request where
    it was, so the retry one by one fails only the request at fault (it once failed the whole batch)."""
    from strata.server.engine import model_runner
    from strata.server.engine.config import EngineConfig
    from strata.server.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dirs["tiny-llama"]), dtype="fp32", kv_cache_memory="8MiB",
                                    block_size=8))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    reference = engine.generate([[5, 6, 7]], params)[0]
    real_sample = model_runner.sample

    def sample_unless_poisoned(logits, seqs, eos_token_ids):
        if any(s.request_id == "poisoned" and s.num_output_tokens >= 2 for s in seqs):
            raise RuntimeError("simulated sampler fault")
        return real_sample(logits, seqs, eos_token_ids)

    monkeypatch.setattr(model_runner, "sample", sample_unless_poisoned)
    good = engine.add_request([5, 6, 7], params)
    engine.add_request([9, 10, 11, 12], params, request_id="poisoned")
    done = run_to_completion(engine)
    assert done["poisoned"].finish_reason == "error" and len(done["poisoned"].token_ids) == 2
    assert done[good].finish_reason == "length" and done[good].token_ids == reference.token_ids
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_extreme_settings_through_the_engine_finish_normally(tiny_model_dirs):
    from strata.server.engine.config import EngineConfig
    from strata.server.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dirs["tiny-llama"]), dtype="fp32", kv_cache_memory="8MiB",
                                    block_size=8))
    params = [SamplingParams(temperature=1e-45, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=1.0, top_p=1e-300, max_tokens=5, ignore_eos=True, seed=2**64 - 1),
              SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)]
    outs = engine.generate([[5, 6, 7]] * 3, params)
    assert [o.finish_reason for o in outs] == ["length"] * 3
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids     # all three are greedy in effect


def run_to_completion(engine) -> dict:
    """Step until every request has finished; the last output of each, by request id."""
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done
