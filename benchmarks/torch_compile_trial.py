"""Does torch.compile make the CPU decode step faster? The default model's decode step eager and compiled (inductor),
with the C++ kernels (whose calls inductor cannot trace: the graph breaks around each) and with the plain torch
path (dense fp32 weights, torch attention and layer ops: everything traceable), at batch 1 and 4.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/torch_compile_trial.py [--batches 1 4] [--steps 30] [--threads 2]

Prints JSON: median step ms per configuration, eager and compiled, and the compile time (the first compiled steps,
inductor's cache cold unless TORCHINDUCTOR_CACHE_DIR holds an earlier run).
"""

import argparse
import json
import os
import statistics
import time

import torch

from strata.server.bench.kv import cpu_isa, cpu_name, machine_note
from strata.server.engine.config import EngineConfig
from strata.server.engine.llm_engine import LLMEngine
from strata.server.engine.sampling_params import SamplingParams

CONFIGS = {"cpu-kernels": {"quantization": "auto", "attention_backend": "cpu"},
           "torch-only": {"dtype": "fp32", "quantization": "none", "attention_backend": "torch"}}


def decoding_engine(config: dict, batch: int, threads: int) -> LLMEngine:
    engine = LLMEngine(EngineConfig(kv_cache_memory="1GiB", num_threads=threads, **config))
    for i in range(batch):
        engine.add_request([(7 * i + 13 * t) % 4000 + 100 for t in range(64)],
                           SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True))
    while any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running + list(engine.scheduler.waiting)):
        engine.step()
    return engine


def median_step_ms(engine: LLMEngine, steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e3, 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    load_at_start = os.getloadavg()
    results = []
    for name, config in CONFIGS.items():
        for batch in args.batches:
            engine = decoding_engine(config, batch, args.threads)
            eager = median_step_ms(engine, args.steps)
            engine.runner.model = torch.compile(engine.model, dynamic=True)
            start = time.perf_counter()
            for _ in range(3):            # the first compiles; a changing block-table width may recompile once
                engine.step()
            compile_s = time.perf_counter() - start
            compiled = median_step_ms(engine, args.steps)
            results.append({"config": name, "weights": engine.weight_format, "batch": batch, "eager_step_ms": eager,
                            "compiled_step_ms": compiled, "compiled_over_eager": round(compiled / eager, 3),
                            "compile_s": round(compile_s, 1)})
            print(json.dumps(results[-1]), flush=True)
            del engine
            torch._dynamo.reset()
    print(json.dumps({"threads": args.threads, "torch": torch.__version__, "cpu": cpu_name(), "isa": cpu_isa(),
                      "configs": CONFIGS, "machine_note": machine_note(load_at_start), "results": results}, indent=1))


if __name__ == "__main__":
    main()
