"""Time of every linear layer of one SmolLM2-135M decode step on the CPU weight kernel, per weight format and batch.

    .venv/bin/python benchmarks/linear_kernel.py [--threads 2] [--formats f16 int8 int4] [--batches 1 4 16 32] \
        [--weights streamed|cached] [--march haswell] [--prefill] [--widen]

Prints JSON: milliseconds per step (30 layers' q/k/v, o, gate/up and down projections, plus the lm_head) and the
effective weight bytes per second. `streamed` (the default) gives each of the 121 layers its own weights, so they
come from DRAM as in the engine; `cached` reuses one layer per shape, which stays in cache and measures the kernel's
arithmetic alone. `--prefill` leaves the lm_head out (a prefill computes logits for its last rows only); `--widen`
times what Q8_0 / Q4 layers did above 32 rows until the tiled integer kernel: the weight widened to fp32, then BLAS.

`--paired-with FILE.so` times this checkout's kernels against another build's compiled module (another checkout's
`strata_cpu_kernels_*.so` under TORCH_EXTENSIONS_DIR), streamed weights, one whole step on each in turn per
repetition (which goes first alternates): on a VM whose host adds noise of tens of percent between runs, both sides
meet the same noise, and the median of the per-repetition ratios is the comparison.
"""

import argparse
import functools
import importlib.machinery
import importlib.util
import json
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from strata.kernels.cpu import build, weight_linear
from strata.models.compact_linear import CompactLinear
from strata.server.bench.kv import cpu_isa, cpu_name

# (out_features, in_features, how many per step) for SmolLM2-135M
SHAPES = {"qkv": (960, 576, 30), "o": (576, 576, 30), "gate_up": (3072, 576, 30), "down": (576, 1536, 30),
          "lm_head": (49152, 576, 1)}


def widened(layer: CompactLinear, x: torch.Tensor) -> torch.Tensor:
    """The whole weight widened to fp32, then BLAS."""
    return torch.nn.functional.linear(x, layer.unpacked_weight())


def step_order(layers: dict[str, list[CompactLinear]], batch: int, shapes: list[str]) -> list:
    """(layer, activations) of one step in the engine's order, each layer with its own weights."""
    xs = {k: torch.randn(batch, k) for _, k, _ in SHAPES.values()}
    order = [(layers[name][i], xs[SHAPES[name][1]]) for i in range(30) for name in shapes if name != "lm_head"]
    return order + ([(layers["lm_head"][0], xs[SHAPES["lm_head"][1]])] if "lm_head" in shapes else [])


def pass_ms(order: list, call) -> float:
    start = time.perf_counter()
    for layer, x in order:
        call(layer, x)
    return (time.perf_counter() - start) * 1e3


def streamed_step_ms(layers: dict[str, list[CompactLinear]], batch: int, call, shapes: list[str],
                     repeats: int) -> float:
    """Median time of one pass over every layer of a step, each with its own weights."""
    order = step_order(layers, batch, shapes)
    call(*order[0])     # the first call of a process pays for allocations the engine has long made
    return statistics.median(pass_ms(order, call) for _ in range(repeats))


def paired_step_ms(layers: dict[str, list[CompactLinear]], batch: int, call, shapes: list[str], ours, theirs,
                   repeats: int) -> dict:
    """Whole steps on this build's module and another's in turn: medians, and the median ratio ours / theirs."""
    order = step_order(layers, batch, shapes)
    times = {"ours": [], "theirs": []}
    for repeat in range(repeats + 1):
        sides = [("ours", ours), ("theirs", theirs)]
        for side, module in sides if repeat % 2 else sides[::-1]:
            weight_linear.load = lambda module=module: module
            ms = pass_ms(order, call)
            if repeat:      # the first round warms both
                times[side].append(ms)
    ratios = [a / b for a, b in zip(times["ours"], times["theirs"], strict=True)]
    return {"ours_ms": round(statistics.median(times["ours"]), 2),
            "theirs_ms": round(statistics.median(times["theirs"]), 2),
            "ratio_ours_over_theirs": round(statistics.median(ratios), 3), "repeats": repeats}


def compiled_module(path: Path):
    """A compiled kernels module from its .so (its name is the file's, so two checkouts' load side by side)."""
    name = path.name.split(".")[0]
    spec = importlib.util.spec_from_file_location(name, path, loader=importlib.machinery.ExtensionFileLoader(
        name, str(path)))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cached_step_ms(layers: dict[str, list[CompactLinear]], batch: int, call, shapes: list[str]) -> float:
    total = 0.0
    for name in shapes:
        _, k, per_step = SHAPES[name]
        x, layer = torch.randn(batch, k), layers[name][0]
        calls = 10 if name == "lm_head" else 100
        for _ in range(3):
            call(layer, x)
        start = time.perf_counter()
        for _ in range(calls):
            call(layer, x)
        total += (time.perf_counter() - start) / calls * per_step
    return total * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--formats", nargs="+", default=["f16", "int8", "int4"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--weights", choices=["streamed", "cached"], default="streamed")
    ap.add_argument("--march", default=None, help="build the kernels for this -march instead (haswell: the AVX2-only "
                                                   "code paths, timed on this CPU)")
    ap.add_argument("--prefill", action="store_true", help="the 120 decoder linears only, no lm_head")
    ap.add_argument("--widen", action="store_true", help="widen each weight to fp32 and call BLAS instead")
    ap.add_argument("--paired-with", type=Path, default=None,
                    help="another build's compiled strata_cpu_kernels_*.so, timed in turn with this one's")
    ap.add_argument("--repeats", type=int, default=None, help="streamed passes per batch (default 7, paired 20)")
    args = ap.parse_args()
    if args.paired_with and (args.weights != "streamed" or args.widen):
        ap.error("--paired-with times streamed weights on the kernel")
    shapes = [name for name in SHAPES if not (args.prefill and name == "lm_head")]
    call = widened if args.widen else CompactLinear.__call__
    torch.set_num_threads(args.threads)
    ours = build.build_for_march(args.march) if args.march else weight_linear.load()
    weight_linear.load = lambda: ours
    theirs = compiled_module(args.paired_with) if args.paired_with else None
    results = []
    with torch.no_grad():
        for fmt in args.formats:
            copies = {name: per_step if args.weights == "streamed" else 1 for name, (_, _, per_step) in SHAPES.items()}
            layers = {name: [CompactLinear.from_linear(nn.Linear(k, n, bias=False).requires_grad_(False), fmt)
                             for _ in range(copies[name])] for name, (n, k, _) in SHAPES.items()}
            weight_bytes = sum(layers[name][0].weight.nbytes * SHAPES[name][2] for name in shapes)
            step_ms = (functools.partial(streamed_step_ms, repeats=args.repeats or 7) if args.weights == "streamed"
                       else cached_step_ms)
            for batch in args.batches:
                if theirs is not None:
                    results.append({"format": fmt, "batch": batch} | paired_step_ms(
                        layers, batch, call, shapes, ours, theirs, args.repeats or 20))
                    continue
                ms = step_ms(layers, batch, call, shapes)
                results.append({"format": fmt, "batch": batch, "linear_ms_per_step": round(ms, 2),
                                "weight_gb_s": round(weight_bytes / ms / 1e6, 1)})
    print(json.dumps({"threads": args.threads, "weights": args.weights, "march": args.march or "native",
                      "layers": "decoder linears (prefill)" if args.prefill else "decoder linears and lm_head",
                      "path": "widened to fp32, BLAS" if args.widen else "kernel",
                      "paired_with": str(args.paired_with) if args.paired_with else None,
                      "cpu": cpu_name(), "isa": cpu_isa(),
                      "results": results}, indent=1))


if __name__ == "__main__":
    main()
