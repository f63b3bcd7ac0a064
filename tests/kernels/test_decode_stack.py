"""The decoder stack as one C++ call (kernels/cpu/decode_stack.py) against the layer-by-layer path it replaces: every
logit of every step bit for bit the same, for each compact weight format, with an attention bias (Qwen2), mixed
batches and speculative drafts; and it must be what pure-decode steps actually ran."""

import dataclasses

import pytest
import torch

from strata.kernels.backend import cpu_kernel_builds
from strata.kernels.cpu.decode_stack import DecodeStack
from strata.server.engine.config import EngineConfig
from strata.server.engine.llm_engine import LLMEngine
from strata.server.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not cpu_kernel_builds(), reason="the C++ CPU kernels cannot be built here")

PROMPTS = [[(7 * i + 13 * t) % 500 + 3 for t in range(n)] for i, n in enumerate((5, 23, 40, 9))]
MAX_TOKENS = (24, 12, 18, 30)


def run(model_dir, quantization: str, stack: bool, kv_dtype: str = "auto"):
    """Greedy outputs and the logits of every step; with stack=False the same engine runs layer by layer."""
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="fp32", quantization=quantization, kv_dtype=kv_dtype,
                                    kv_cache_memory="16MiB", block_size=8))
    if not stack:
        engine.runner.backend = dataclasses.replace(engine.runner.backend, decode_stack=False)
    logits = []
    compute = engine.model.compute_logits
    engine.model.compute_logits = lambda hidden: logits.append(compute(hidden)) or logits[-1]
    sampling = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    # staggered arrivals and ends: prefill chunks and decode rows share steps, then pure-decode steps of 4 to 1 rows
    requests = list(zip(PROMPTS, sampling, strict=True))
    ids = [engine.add_request(p, sp) for p, sp in requests[:2]]
    engine.step()
    ids += [engine.add_request(p, sp) for p, sp in requests[2:]]
    done = {}
    while len(done) < len(ids):
        done |= {out.request_id: out.token_ids for out in engine.step() if out.finished}
    return [done[i] for i in ids], logits, engine


@pytest.mark.parametrize("quantization", ["f16", "bf16", "int8", "int4"])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_stack_matches_the_layer_path_bit_for_bit(tiny_model_dirs, name, quantization, monkeypatch):
    calls = []
    stack_call = DecodeStack.__call__
    monkeypatch.setattr(DecodeStack, "__call__", lambda self, *a: calls.append(a[0].shape[0]) or stack_call(self, *a))
    tokens, logits, engine = run(tiny_model_dirs[name], quantization, stack=True)
    ran = len(calls)
    reference, reference_logits, _ = run(tiny_model_dirs[name], quantization, stack=False)
    assert len(calls) == ran, "the layer path must not call the stack"
    assert engine.model.decode_stack is not None
    assert ran > 20 and set(calls) >= {1, 4}, "pure-decode steps of one and several rows must run through the stack"
    assert tokens == reference
    assert len(logits) == len(reference_logits)
    for mine, theirs in zip(logits, reference_logits, strict=True):
        assert torch.equal(mine, theirs)


def test_drafts_verified_through_the_stack_keep_the_outputs(tiny_model_dirs, monkeypatch):
    """Prompt-lookup drafts make decode steps of several rows per sequence: same logits with and without the stack."""
    calls = []
    stack_call = DecodeStack.__call__
    monkeypatch.setattr(DecodeStack, "__call__", lambda self, *a: calls.append(a[0].shape[0]) or stack_call(self, *a))
    config = {"model": str(tiny_model_dirs["tiny-llama"]), "dtype": "fp32", "quantization": "int8",
              "kv_cache_memory": "16MiB", "block_size": 8, "speculative": "ngram", "num_speculative_tokens": 4,
              "speculative_policy": "always"}
    outputs = []
    for stack in (True, False):
        engine = LLMEngine(EngineConfig(**config))
        if not stack:
            engine.runner.backend = dataclasses.replace(engine.runner.backend, decode_stack=False)
        repetitive = [p * 3 for p in PROMPTS]        # prompt lookup finds its n-grams again
        outs = engine.generate(repetitive, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
        outputs.append([o.token_ids for o in outs])
    assert outputs[0] == outputs[1]
    assert max(calls) > len(PROMPTS), "steps carrying drafts (several rows per sequence) must run through the stack"


def test_int8_kv_and_dense_weights_keep_the_layer_path(tiny_model_dirs, monkeypatch):
    monkeypatch.setattr(DecodeStack, "__call__", lambda *a: pytest.fail("the stack ran"))
    tokens, _, _ = run(tiny_model_dirs["tiny-llama"], "int8", stack=True, kv_dtype="int8")
    assert [len(t) for t in tokens] == list(MAX_TOKENS)
    _, _, engine = run(tiny_model_dirs["tiny-llama"], "none", stack=True)
    assert engine.model.decode_stack is None
