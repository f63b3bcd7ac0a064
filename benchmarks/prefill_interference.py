"""How much one long prompt delays the requests decoding beside it, by step token budget and prefill cap.

Chunked prefill puts every running decode into each step beside the long prompt's next chunk, so a short request's
inter-token time is one chunk's step time. Each setting BUDGET/CAP is --max-num-batched-tokens / --prefill-beside-
decodes (CAP = BUDGET: no cap, the behaviour before the cap existed). One engine per setting runs short requests
decoding, then a long prompt arriving; it reports the long prompt's time to first token, the short requests'
inter-token p50 / max while it prefills, and a throughput workload (16 requests of 64-token prompts arriving together)
so that a setting's cost shows too. Prints JSON; --plot draws the trade-off.

    python benchmarks/prefill_interference.py --settings 2048/2048 2048/256 256/256 --out results/x.json
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

from strata.server.bench.throughput import make_workload, time_engine
from strata.server.engine.config import EngineConfig
from strata.server.engine.llm_engine import LLMEngine
from strata.server.engine.sampling_params import SamplingParams


def interference(engine: LLMEngine, long_tokens: int, shorts: int, seed: int) -> dict:
    """Shorts decode; the long prompt arrives once they have their first token; step until it has its first."""
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    short_params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    short_ids = [engine.add_request(prompt(32), short_params) for _ in range(shorts)]
    while not all(engine.requests[i].num_output_tokens for i in short_ids):
        engine.step()
    long_id = engine.add_request(prompt(long_tokens), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    arrived = last = time.perf_counter()
    gaps, ttft = [], None
    while ttft is None:
        outs = engine.step()
        now = time.perf_counter()
        if any(o.request_id in short_ids for o in outs):
            gaps.append(now - last)
            last = now
        if any(o.request_id == long_id for o in outs):
            ttft = now - arrived
    for i in short_ids:
        engine.abort(i)
    return {"long_ttft_s": round(ttft, 3), "short_itl_p50_ms": round(statistics.median(gaps) * 1000, 1),
            "short_itl_max_ms": round(max(gaps) * 1000, 1), "short_tokens_during_prefill": len(gaps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", nargs="+", default=["2048/2048", "2048/256", "512/512", "256/256"],
                        help="BUDGET/CAP pairs: --max-num-batched-tokens / --prefill-beside-decodes")
    parser.add_argument("--long-tokens", type=int, default=4096)
    parser.add_argument("--shorts", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    try:
        settings = [tuple(int(x) for x in text.split("/")) for text in args.settings]
    except ValueError:
        parser.error("--settings takes BUDGET/CAP pairs of integers, e.g. 2048/256")
    if any(len(pair) != 2 or min(pair) < 1 for pair in settings) or args.long_tokens < 1 or args.shorts < 1:
        parser.error("settings, --long-tokens and --shorts must be >= 1")
    rows = []
    for budget, cap in settings:
        engine = LLMEngine(EngineConfig(dtype=args.dtype, kv_cache_memory="1GiB", max_num_batched_tokens=budget,
                                        prefill_beside_decodes=cap, enable_prefix_caching=False))
        interference(engine, 256, 1, seed=99)           # warm-up: kernels built, buffers grown
        row = {"max_num_batched_tokens": budget, "prefill_beside_decodes": cap,
               **interference(engine, args.long_tokens, args.shorts, seed=1)}
        workload = make_workload(16, (64, 64), (32, 32), engine.model_config.vocab_size, workload_seed=2)
        row["throughput_16x64_tok_s"] = time_engine(engine, workload)["tok_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    result = {"machine": {"cpu": platform.processor() or next((line.split(":", 1)[1].strip() for line in
                                                                 open("/proc/cpuinfo") if line.startswith("model name")),
                                                                ""),
                          "flags": sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c")))},
              "long_tokens": args.long_tokens, "shorts": args.shorts, "rows": rows}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([r["long_ttft_s"] for r in rows], [r["short_itl_p50_ms"] for r in rows], "o-")
        for r in rows:
            ax.annotate(f'{r["max_num_batched_tokens"]}/{r["prefill_beside_decodes"]}',
                        (r["long_ttft_s"], r["short_itl_p50_ms"]))
        ax.set_xlabel(f"time to first token of a {args.long_tokens}-token prompt (s)")
        ax.set_ylabel("inter-token time of requests beside it, p50 (ms)")
        ax.set_title("--max-num-batched-tokens / --prefill-beside-decodes")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
