"""Profile decode steps of the default model on CPU at a few batch sizes: step time, then torch.profiler's top ops.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/cpu_profile.py [--batches 1 4] [--dtype fp32] [--steps 30] \
        [--quantization none f16 gguf] [--layer-path]

Prints JSON (median step ms per weight format and batch, and the ops that dominate); the formats run one after the other in
one process, so on a shared machine compare them as ratios. --trace DIR also writes a Chrome trace per run.
--layer-path also times the same engine with the decoder run layer by layer from Python instead of as one C++ call
(kernels/cpu/decode_stack.py), in alternating rounds of steps, and reports both.
py-spy shows the Python side: `py-spy record -o flame.svg -- python benchmarks/cpu_profile.py`.
"""

import argparse
import dataclasses
import json
import os
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from strata.server.bench.kv import cpu_isa, cpu_name, machine_note
from strata.server.engine.config import EngineConfig
from strata.server.engine.llm_engine import LLMEngine
from strata.server.engine.sampling_params import SamplingParams


def decode_engine(args: argparse.Namespace, weights: str, batch: int) -> LLMEngine:
    """An engine whose `batch` sequences are past their 64-token prompts: every step that follows is pure decode."""
    engine = LLMEngine(EngineConfig(dtype=args.dtype, quantization=weights, kv_cache_memory="1GiB",
                                    num_threads=args.threads))
    for i in range(batch):
        prompt = [(7 * i + 13 * t) % 4000 + 100 for t in range(64)]
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True))
    while any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running + list(engine.scheduler.waiting)):
        engine.step()
    return engine


def top_ops(prof, n: int) -> list[dict]:
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:n]
    total = sum(e.self_cpu_time_total for e in prof.key_averages())
    return [{"op": e.key, "calls": e.count, "self_ms": round(e.self_cpu_time_total / 1e3, 2),
             "share": round(e.self_cpu_time_total / total, 3)} for e in rows]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--quantization", nargs="+", default=["none"], help="weight formats to compare, in one run")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--layer-path", action="store_true", help="also time the layer-by-layer Python path")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds the steps are split into")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (1 is steadier on a shared machine)")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--trace", default=None)
    args = ap.parse_args()
    load_at_start = os.getloadavg()
    results = []
    for weights in args.quantization:
        for batch in args.batches:
            engine = decode_engine(args, weights, batch)
            for _ in range(3):
                engine.step()
            stack_backend = engine.runner.backend
            paths = {"step_ms": stack_backend}
            if args.layer_path:
                paths["step_ms_layer_path"] = dataclasses.replace(stack_backend, decode_stack=False)
            times = {name: [] for name in paths}
            for _ in range(args.rounds):      # alternating rounds: drift and other jobs' bursts hit both paths alike
                for name, backend in paths.items():
                    engine.runner.backend = backend
                    for _ in range(args.steps // args.rounds):
                        start = time.perf_counter()
                        engine.step()
                        times[name].append(time.perf_counter() - start)
            engine.runner.backend = stack_backend
            # the median: other jobs' bursts stretch a few steps
            step = {name: round(statistics.median(t) * 1e3, 2) for name, t in times.items()}
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    engine.step()
            if args.trace:
                prof.export_chrome_trace(f"{args.trace}/decode_{weights}_batch{batch}.json")
            results.append({"weights": engine.weight_format, "batch": batch, **step,
                            "tok_s": round(batch * 1e3 / step["step_ms"], 1), "profiled_steps": 5,
                            "top_ops": top_ops(prof, args.top)})
            del engine
    print(json.dumps({"dtype": args.dtype, "threads": torch.get_num_threads(), "cpu": cpu_name(), "isa": cpu_isa(),
                      "machine_note": machine_note(load_at_start), "results": results}, indent=1))


if __name__ == "__main__":
    main()
