"""`strata bench spec` end to end on the tiny chat model: the JSON the issue asks for, and outputs identical to the
runs without drafts (greedy)."""

import dataclasses

from strata.server.bench.spec import prompt_lookup_ceiling, run_spec_bench


def test_spec_bench_reports_each_workload_and_identical_outputs(tiny_chat_engine):
    config = dataclasses.replace(tiny_chat_engine, speculative="ngram")
    result = run_spec_bench(config, batch_sizes=(1, 3), max_tokens=12, num_prompts=2, repeats=2,
                            names=("code", "chat"))
    assert result["identical"] == 1.0
    assert set(result["workloads"]) == {"code", "chat"}
    for workload in result["workloads"].values():
        assert workload["speedup_batch1"] == workload["batches"]["1"]["speedup"] > 0
        assert 0.0 <= workload["acceptance"] <= 1.0
        for row in workload["batches"].values():
            assert len(row["speedup_per_repeat"]) == 2 and all(r > 0 for r in row["speedup_per_repeat"])
            assert row["output_tokens"] > 0 and row["identical"] == 1.0
        # batch 1 runs every prompt, one at a time; batch 3 runs one group of 3 (the 2 prompts and a repeat)
        assert workload["batches"]["1"]["requests"] == 2 and workload["batches"]["3"]["requests"] == 3
        assert workload["ngram_ceiling"] >= 1.0


def test_prompt_lookup_ceiling_counts_the_steps_perfect_drafting_needs():
    prompt = [1, 2, 3, 4, 5, 6]
    # 3, then 4 (no match yet), then [3, 4] matches the prompt: draft [5, 6, 3] keeps 5, 6 and 7 is the model's own;
    # then 1 (no match): 6 tokens in 4 steps
    assert prompt_lookup_ceiling([prompt], [[3, 4, 5, 6, 7, 1]], 3) == 1.5
    # copied from the prompt: 2, 3 one step each, then the draft [4, 5, 6] kept whole: 5 tokens in 3 steps
    assert prompt_lookup_ceiling([prompt], [[2, 3, 4, 5, 6]], 3) == round(5 / 3, 3)
    # its own repeats count too, once a 2-token tail has a successor: 9, 9, 9 alone, then the draft [9] kept
    assert prompt_lookup_ceiling([prompt], [[9, 9, 9, 9]], 3) == 1.0
