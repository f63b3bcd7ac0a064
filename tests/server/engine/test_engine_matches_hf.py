"""Greedy outputs of our engine are token-identical to HF transformers on the same fp32 weights."""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from strata.server.engine.config import EngineConfig
from strata.server.engine.llm_engine import LLMEngine
from strata.server.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

NEW_TOKENS = 32
PROMPTS = [
    ("What is the capital of France?", True),
    ("Explain photosynthesis in one sentence.", True),
    ("Write a haiku about autumn leaves.", True),
    ("List three prime numbers greater than 100.", True),
    ("How do I reverse a list in Python?", True),
    ("Translate 'good morning' into Spanish.", True),
    ("Give me a short tip for better sleep.", True),
    ("What does a paged KV cache store, and why does paging help an inference server?", True),
    ("def fibonacci(n):", False),
    ("Once upon a time, in a small village by the sea,", False),
    ("The three laws of thermodynamics are", False),
    ("SELECT name, email FROM users WHERE", False),
    ("In 1969, the first humans", False),
    ("Roses are red,", False),
    ("The quick brown fox", False),
    ("Dear hiring manager, I am writing to apply for the position of senior engineer because", False),
]


def hf_greedy(model, prompt_ids: list[int], eos: int | None) -> list[int]:
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                         eos_token_id=eos, pad_token_id=eos if eos is not None else 0)
    tokens = out[0, len(prompt_ids):].tolist()
    if eos is not None and eos in tokens:
        tokens = tokens[: tokens.index(eos) + 1]
    return tokens


@pytest.fixture(scope="module")
def default_engine(default_model_dir):
    return LLMEngine(EngineConfig(model=str(default_model_dir), dtype="fp32", kv_cache_memory="512MiB"))


@pytest.fixture(scope="module")
def hf_expected(default_model_dir, default_engine):
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    prompt_ids = [default_engine.inputs.encode(text, chat=chat) for text, chat in PROMPTS]
    eos = default_engine.tokenizer.eos_token_id
    return prompt_ids, [hf_greedy(model, ids, eos) for ids in prompt_ids]


def test_default_model_one_by_one(default_engine, hf_expected):
    """Batch size 1 on every third prompt (chat and plain, the longest included); the mixed batch below runs all."""
    prompt_ids, expected = (rows[::3] for rows in hf_expected)
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    got = [default_engine.generate([ids], greedy)[0].token_ids for ids in prompt_ids]
    assert got == expected
    assert default_engine.block_manager.num_free_blocks == default_engine.block_manager.num_blocks


def test_default_model_one_mixed_batch(default_engine, hf_expected):
    prompt_ids, expected = hf_expected
    lengths = {len(ids) for ids in prompt_ids}
    assert len(lengths) > 8  # really mixed lengths in one batch
    outs = default_engine.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    assert [o.token_ids for o in outs] == expected


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_tiny_random_models(tiny_model_dirs, name):
    path = tiny_model_dirs[name]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(1, 70))] for _ in range(12)]
    expected = [hf_greedy(model, p, None) for p in prompts]
    engine = LLMEngine(EngineConfig(model=str(path), dtype="fp32", kv_cache_memory="64MiB", block_size=8,
                                    max_num_batched_tokens=64))  # chunked prefill across several steps
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    assert [engine.generate([p], params)[0].token_ids for p in prompts] == expected
    assert [o.token_ids for o in engine.generate(prompts, params)] == expected
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
