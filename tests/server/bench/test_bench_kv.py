"""`strata bench kv` on a tiny checkpoint: the rows carry every field, and INT8 KV holds more of the workload."""

from strata.server.bench.kv import agreement, run_kv_sweep
from strata.server.engine.config import EngineConfig

KEYS = {"block_size", "kv_dtype", "swap_gib", "preemption_mode", "prefix_caching", "tok_s", "ttft_ms_p50",
        "kv_tokens_capacity", "max_running_seqs", "preemptions", "ppl"}


def test_kv_sweep_rows(tiny_model_dirs):
    config = EngineConfig(model=str(tiny_model_dirs["tiny-llama"]), dtype="fp32", kv_cache_memory="64KiB",
                          max_num_batched_tokens=256)
    settings = [dict(block_size=16, kv_dtype=d, swap_gib=0.001, preemption_mode="swap", prefix_caching=True)
                for d in ("fp32", "int8")]
    fp32, int8 = run_kv_sweep(config, settings, num_requests=8, system_tokens=32, unique_range=(8, 16),
                              output_tokens=16, ppl_tokens=32)
    assert KEYS <= fp32.keys() and KEYS <= int8.keys()
    assert int8["kv_tokens_capacity"] > 3 * fp32["kv_tokens_capacity"]
    assert int8["max_running_seqs"] > fp32["max_running_seqs"]  # the pool, not max_num_seqs, limits fp32
    assert fp32["preemptions"] > int8["preemptions"]
    assert abs(int8["ppl"] / fp32["ppl"] - 1) < 0.02


def test_agreement_counts_up_to_first_divergence():
    reference = [[1, 2, 3, 4], [1, 2, 3, 4]]
    result = agreement(reference, [[1, 2, 3, 4], [1, 9, 3, 4]])  # tokens after a divergence do not count
    assert result == {"token_agreement_to_first_divergence": 5 / 8, "fully_identical_share": 0.5,
                      "first_divergence_positions": [4, 1]}
