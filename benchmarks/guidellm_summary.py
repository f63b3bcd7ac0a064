"""Summary of two guidellm JSON reports (request cache on / off, same workload): throughput, TTFT p50 and request
latency p50 of each, their ratios, and the machine the runs came from. Prints JSON; stdlib only, so any python runs
it. Used by benchmarks/guidellm_cache.sh."""

import argparse
import json
import os
import platform
import time
from pathlib import Path


def machine() -> dict:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags: set[str] = set()
    model = platform.processor() or "unknown"
    for line in info.splitlines():
        if line.startswith("model name") and ":" in line:
            model = line.split(":", 1)[1].strip()
        elif line.startswith("flags") and ":" in line:
            flags.update(line.split(":", 1)[1].split())
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {"cpu": model, "cores": os.cpu_count(), "avx2": "avx2" in flags, "avx512f": "avx512f" in flags,
            "avx512_bf16": "avx512_bf16" in flags, "amx": "amx_tile" in flags,
            "load_average_1_5_15_at_end": [round(x, 2) for x in load] if load else None,
            "note": "shared 2-core VM: another engineer's tests may run at the same time; compare the ratio"}


def figures(path: str) -> dict:
    report = json.loads(Path(path).read_text())
    bench = report["benchmarks"][0]
    metrics = bench["metrics"]
    totals = metrics["request_totals"]
    duration = bench["duration"]
    out_tokens = metrics["output_token_count"]["successful"]["total_sum"]

    def p50(name: str) -> float:
        return metrics[name]["successful"]["percentiles"]["p50"]

    return {"report": Path(path).name, "guidellm_version": report["metadata"].get("guidellm_version"),
            "profile": bench["config"]["strategy"]["type_"] if "strategy" in bench["config"] else None,
            "requests": totals, "duration_s": round(duration, 3),
            "requests_per_s": round(totals["successful"] / duration, 3),
            "output_tokens_per_s": round(out_tokens / duration, 2),
            "ttft_ms_p50": round(p50("time_to_first_token_ms"), 2),
            "itl_ms_p50": round(p50("inter_token_latency_ms"), 2),
            "request_latency_s_p50": round(p50("request_latency"), 4),
            "request_latency_s_mean": round(metrics["request_latency"]["successful"]["mean"], 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("with_cache")
    ap.add_argument("without_cache")
    ap.add_argument("--requests", type=int)
    ap.add_argument("--distinct", type=int)
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--output-tokens", type=int)
    ap.add_argument("--num-threads")
    ap.add_argument("--metrics-with", help="strata /metrics lines (request cache) after the cached run")
    args = ap.parse_args()
    on, off = figures(args.with_cache), figures(args.without_cache)
    server_metrics = None
    if args.metrics_with and Path(args.metrics_with).exists():
        server_metrics = [line for line in Path(args.metrics_with).read_text().splitlines()
                          if line.startswith(("strata_request_cache_hits", "strata_request_cache_lookups"))]
    summary = {
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "workload": {"requests": args.requests, "distinct_prompts": args.distinct, "repeats_each": args.repeats,
                     "output_tokens": args.output_tokens, "ignore_eos": True, "temperature": 0,
                     "endpoint": "/v1/chat/completions", "stream": True, "profile": "synchronous",
                     "expected_cache_hits": (args.distinct * (args.repeats - 1)
                                             if args.distinct and args.repeats else None)},
        "server": {"model": "SmolLM2-135M-Instruct (default)", "cache_db": "none (in memory)",
                   "num_threads": args.num_threads, "host": "127.0.0.1"},
        "with_cache": on,
        "without_cache": off,
        "ratio_with_over_without": {
            "requests_per_s": round(on["requests_per_s"] / off["requests_per_s"], 2),
            "output_tokens_per_s": round(on["output_tokens_per_s"] / off["output_tokens_per_s"], 2),
        },
        "ratio_without_over_with": {
            "ttft_ms_p50": round(off["ttft_ms_p50"] / on["ttft_ms_p50"], 2),
            "request_latency_s_p50": round(off["request_latency_s_p50"] / on["request_latency_s_p50"], 2),
        },
        "strata_metrics_after_cached_run": server_metrics,
        "machine": machine(),
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
