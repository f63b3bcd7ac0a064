"""KV levers: INT8 capacity, swap and recompute preemption under an oversubscribed pool, prefix caching."""

import random

import pytest
import xxhash

from strata.cache.kv.block_manager import BlockManager
from strata.cache.kv.storage import KVLayout
from strata.server.engine.config import EngineConfig
from strata.server.engine.llm_engine import LLMEngine
from strata.server.engine.sampling_params import SamplingParams
from strata.server.engine.sequence import Sequence

TINY_BLOCK = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=8, kv_dtype="fp32").block_bytes


def test_int8_blocks_hold_more_tokens_at_the_same_memory():
    # SmolLM2-135M's KV shape: 30 layers, 3 KV heads of 64.
    def capacity(kv_dtype: str) -> int:
        layout = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, kv_dtype=kv_dtype)
        return (2**30 // layout.block_bytes) * layout.block_size

    assert capacity("int8") >= 1.9 * capacity("bf16")
    assert capacity("int8") >= 3.8 * capacity("fp32")


def test_engine_reports_int8_capacity(tiny_model_dirs):
    caps = {kv: LLMEngine(EngineConfig(model=str(tiny_model_dirs["tiny-llama"]), dtype="fp32", kv_dtype=kv,
                                       kv_cache_memory="4MiB", block_size=8)).kv_capacity_tokens
            for kv in ("fp32", "int8")}
    assert caps["int8"] >= 3 * caps["fp32"]  # head_dim 16: scales cost relatively more than at 64


@pytest.fixture(scope="module")
def long_workload():
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(40, 90))] for _ in range(24)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randrange(24, 48), ignore_eos=True) for _ in prompts]
    return prompts, params


@pytest.fixture(scope="module")
def unconstrained(tiny_model_dirs, long_workload):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dirs["tiny-llama"]), dtype="fp32", block_size=8,
                                    kv_cache_memory="64MiB", max_num_batched_tokens=256))
    return [o.token_ids for o in engine.generate(*long_workload)]


@pytest.mark.parametrize("mode, swap_gib", [("swap", 0.01), ("recompute", 0.0), ("swap", 20 * TINY_BLOCK / 2**30)])
def test_oversubscribed_pool_completes_every_request_identically(tiny_model_dirs, long_workload, unconstrained,
                                                                 mode, swap_gib):
    # A pool for about 4 of the 24 requests (each needs up to 17 blocks of 8 tokens).
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dirs["tiny-llama"]), dtype="fp32", block_size=8,
                                    kv_cache_memory=str(60 * TINY_BLOCK), max_num_batched_tokens=256,
                                    preemption_mode=mode, swap_space=swap_gib))
    outs = engine.generate(*long_workload)
    assert [o.token_ids for o in outs] == unconstrained
    stats = engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["swap_slots_free"] == stats["swap_slots_total"]
    if mode == "swap" and swap_gib >= 0.01:
        assert stats["preemptions_swap"] > 0 and stats["swap_in_blocks"] == stats["swap_out_blocks"] > 0
    elif mode == "swap":  # swap space for ~1 sequence: falls back to recompute when full
        assert stats["preemptions_swap"] > 0 and stats["preemptions_recompute"] > 0
    else:
        assert stats["preemptions_recompute"] > 0 and stats["preemptions_swap"] == 0


def test_prefix_caching_reuses_blocks_without_changing_outputs(tiny_model_dirs):
    rng = random.Random(5)
    system = [rng.randrange(3, 512) for _ in range(100)]
    prompts = [system + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 20))] for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    results = {}
    for enabled in (False, True):
        engine = LLMEngine(EngineConfig(model=str(tiny_model_dirs["tiny-llama"]), dtype="fp32", block_size=8,
                                        kv_cache_memory="16MiB", enable_prefix_caching=enabled))
        first = engine.generate(prompts[:1], params)  # computes the shared prefix once
        rest = engine.generate(prompts[1:], params)
        results[enabled] = [o.token_ids for o in first + rest]
        if enabled:
            assert all(o.num_cached_tokens == 96 for o in rest)  # 12 full blocks of the 100-token system prompt
            assert engine.stats()["prefix_cache_hits"] == 7
        else:
            assert all(o.num_cached_tokens == 0 for o in rest)
        assert engine.stats()["kv_blocks_free"] == engine.stats()["kv_blocks_total"]
    assert results[True] == results[False]


def test_prefix_cache_never_matches_different_content_or_another_model():
    def seq(tokens):
        return Sequence("s", list(tokens), SamplingParams())

    a = BlockManager(num_blocks=16, block_size=4, namespace="model-a")
    first = seq(range(3, 20))
    a.allocate(first, 17)
    a.register_computed(first, 17)
    a.free_sequence(first)
    assert len(a.match_prefix(seq(range(3, 20)))) == 4
    assert a.match_prefix(seq([3, 4, 5, 99] + list(range(7, 20)))) == []  # first block differs
    assert len(a.match_prefix(seq(list(range(3, 11)) + [0] * 9))) == 2  # diverges in the third block
    b = BlockManager(num_blocks=16, block_size=4, namespace="model-b")
    assert a.root_hash != b.root_hash
    # Even with a colliding hash, token ids are compared before a block is reused.
    block = a.blocks[a.cached[next(iter(a.cached))]]
    block.token_ids = (0, 0, 0, 0)
    assert a.match_prefix(seq(range(3, 20))) == []
    assert xxhash.xxh3_64_intdigest(b"model-a") == a.root_hash


def test_request_too_long_for_the_whole_pool_is_a_clear_error(tiny_model_dirs):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dirs["tiny-llama"]), dtype="fp32", block_size=8,
                                    kv_cache_memory=str(4 * TINY_BLOCK)))
    with pytest.raises(ValueError, match=r"context is 32 \(all --kv-cache-memory holds\)"):
        engine.add_request(list(range(3, 40)), SamplingParams(max_tokens=4))
    # A prompt that fits but whose output outgrows the whole pool ends with "length" instead of hanging.
    out = engine.generate([list(range(3, 20))], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    # 32 KV slots, so a context of 32 tokens: the prompt and 15 outputs
    assert out.finish_reason == "length" and len(out.token_ids) == 32 - 17
    assert engine.stats()["kv_blocks_free"] == 4


def test_one_token_of_budget_left_never_samples_mid_prompt(tiny_model_dirs):
    """A prompt chunk of one token (after a prefix-cache hit, with one token of budget left) is prefill, not decode."""
    rng = random.Random(9)
    system = [rng.randrange(3, 512) for _ in range(24)]
    prompts = [system + [rng.randrange(3, 512) for _ in range(6)] for _ in range(4)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def run(budget: int) -> list[list[int]]:
        engine = LLMEngine(EngineConfig(model=str(tiny_model_dirs["tiny-llama"]), dtype="fp32", block_size=8,
                                        kv_cache_memory="16MiB", max_num_seqs=2, max_num_batched_tokens=budget))
        first = engine.generate(prompts[:1], params)
        return [o.token_ids for o in first + engine.generate(prompts[1:], params)]

    assert run(2) == run(256)


def test_a_waiting_request_is_hashed_once_not_every_step(monkeypatch):
    """A head-of-line request that waits for blocks is matched against the prefix cache each step; its block hashes
    are kept on the sequence, so each block is hashed once in all."""
    manager = BlockManager(num_blocks=4, block_size=4)
    calls = []
    real = BlockManager.chain_hash
    monkeypatch.setattr(BlockManager, "chain_hash",
                        lambda self, parent, tokens: calls.append(tokens) or real(self, parent, tokens))
    running = Sequence("running", list(range(3, 16)), SamplingParams())
    manager.allocate(running, 13)                         # takes all 4 blocks
    waiting = Sequence("waiting", list(range(100, 133)), SamplingParams())   # 8 full blocks
    hashed_by_running = len(calls)
    for _ in range(20):                                   # twenty scheduler steps
        assert not manager.can_allocate(waiting, 33)
    assert len(calls) - hashed_by_running == 8
    manager.free_sequence(running)
    assert manager.can_allocate(waiting, 16) and len(calls) - hashed_by_running == 8
