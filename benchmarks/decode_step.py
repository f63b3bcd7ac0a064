"""Time one decode step of a full batch: 64 sequences of mixed length (prompts 16-512 tokens), after their prefill.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/decode_step.py [--steps 10] [--dtype bf16]

Prints JSON. To compare with an older commit, put a `strata` symlink to a worktree of it first on PYTHONPATH.
"""

import argparse
import json
import time

import torch

from strata.server.bench.throughput import make_workload
from strata.server.engine.config import EngineConfig
from strata.server.engine.llm_engine import LLMEngine
from strata.server.engine.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--attention-backend", default="auto")
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(dtype=args.dtype, kv_cache_memory="3GiB", attention_backend=args.attention_backend))
    workload = make_workload(64, (16, 512), (200, 256), engine.model_config.vocab_size, workload_seed=0)
    for prompt, n in workload:
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    while any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running + list(engine.scheduler.waiting)):
        engine.step()                          # prefill everything first: what follows is pure decode
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    step_s = (time.perf_counter() - start) / args.steps
    print(json.dumps({"batch": len(engine.scheduler.running), "steps": args.steps, "step_s": round(step_s, 4),
                      "dtype": args.dtype, "threads": torch.get_num_threads(),
                      "attention_backend": engine.backend.name}))


if __name__ == "__main__":
    main()
