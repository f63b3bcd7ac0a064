"""Triton W8A16 / W4A16 linears (kernels/triton/weight_linear.py) against cuBLAS bf16 on Llama-3.2-1B and
Llama-3.1-8B layer shapes, and the error of each against its dequantized weight; a small sweep of tile configs per
row count says which the default picks should become. Run by benchmarks/gpu_check.sh; prints and writes JSON.

Decode is bandwidth-bound: a step's speed-up from Q8_0 / Q4 is at most the byte ratio, 1.9x / 3.2x over bf16.
"""

import argparse
import json
import os
import sys
import time
from dataclasses import astuple
from pathlib import Path

import torch
import triton

from strata.kernels.triton.weight_linear import GROUP, TileConfig, k_splits, linear, pick_config
from strata.models.named_shapes import hf_config_for

# decode tiles, each with K splits picked for the GPU's size and without
SWEEP = [TileConfig(16, n, k, 4, 4, split) for n in (16, 32, 64) for k in (64, 128, 256) for split in (None, 1)]


def layer_shapes(name: str) -> dict[str, tuple[int, int]]:
    """(out, in) of each linear of one decoder layer, q/k/v and gate/up fused as the engine runs them, and lm_head."""
    cfg = hf_config_for(name)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * head_dim
    return {"qkv_proj": (qkv, cfg.hidden_size), "o_proj": (cfg.hidden_size, cfg.num_attention_heads * head_dim),
            "gate_up_proj": (2 * cfg.intermediate_size, cfg.hidden_size),
            "down_proj": (cfg.hidden_size, cfg.intermediate_size), "lm_head": (cfg.vocab_size, cfg.hidden_size)}


def random_blocks(format: str, out_features: int, in_features: int, device: torch.device):
    """Codes, scales and minimums with GGUF's layout and realistic ranges (what the kernel reads; values are random)."""
    groups = in_features // GROUP
    scales = torch.rand(out_features, groups, device=device) * 0.002 + 0.0005
    if format == "q8":
        return torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8, device=device), scales, None
    codes = torch.randint(0, 256, (out_features, in_features // 2), dtype=torch.uint8, device=device)
    return codes, scales, -8 * scales


def dequantized(format: str, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None) -> torch.Tensor:
    """The fp32 weight the blocks stand for (GGUF nibble order: low nibbles are columns 0-15 of a block)."""
    if format == "q8":
        values = codes.float()
    else:
        blocks = codes.view(codes.shape[0], -1, 16)
        values = torch.cat([blocks & 15, blocks >> 4], dim=-1).flatten(1).float()
    weight = values * scales.repeat_interleave(GROUP, 1)
    return weight if mins is None else weight + mins.repeat_interleave(GROUP, 1)


def bench_ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=40)


def time_kernel(x: torch.Tensor, format: str, blocks: tuple, config: TileConfig | None = None) -> float:
    return bench_ms(lambda: linear(x, format, *blocks, x.shape[1], config))


def time_cublas(x: torch.Tensor, out_features: int) -> float:
    """bf16 F.linear (cuBLAS) with a dense weight of the same shape, freed on return."""
    dense = torch.randn(out_features, x.shape[1], device=x.device, dtype=torch.bfloat16) * 0.02
    return bench_ms(lambda: torch.nn.functional.linear(x, dense))


def measure(model: str, layer: str, out_features: int, in_features: int, rows: int, sweep: bool) -> dict:
    device = torch.device("cuda")
    x = torch.randn(rows, in_features, device=device, dtype=torch.bfloat16)
    entry = {"model": model, "layer": layer, "out": out_features, "in": in_features, "rows": rows,
             "cublas_bf16_ms": time_cublas(x, out_features)}
    for format in ("q8", "q4"):
        blocks = random_blocks(format, out_features, in_features, device)
        reference = x.float() @ dequantized(format, *blocks).T
        out = linear(x, format, *blocks, in_features)
        entry[f"{format}_rel_error"] = float((out.float() - reference).abs().max() / reference.abs().max())
        del reference, out
        entry[f"{format}_ms"] = time_kernel(x, format, blocks)
        entry[f"{format}_speedup_vs_bf16"] = entry["cublas_bf16_ms"] / entry[f"{format}_ms"]
        config = pick_config(rows)
        entry[f"{format}_config"] = astuple(config)
        entry[f"{format}_splits"] = k_splits(config, triton.cdiv(out_features, config.block_n) *
                                             triton.cdiv(rows, config.block_m), in_features, device)
        if sweep:
            timed = {astuple(c): time_kernel(x, format, blocks, c) for c in SWEEP}
            best = min(timed, key=timed.get)
            entry[f"{format}_best_config"], entry[f"{format}_best_ms"] = best, timed[best]
        del blocks
    torch.cuda.empty_cache()
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("--models", nargs="+", default=["Llama-3.2-1B", "Llama-3.1-8B"])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 16, 256, 2048])
    parser.add_argument("--sweep-rows", nargs="+", type=int, default=[1, 16],
                        help="row counts at which every tile config of the sweep is timed too")
    parser.add_argument("--budget-s", type=float, default=90.0, help="start no new measurement after this")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_weight_linear: needs an NVIDIA GPU and a CUDA build of torch")
    deadline = time.monotonic() + args.budget_s
    path = Path(args.out) / "gpu_weight_linear.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": []}
    for model in args.models:
        for layer, (out_features, in_features) in layer_shapes(model).items():
            for rows in args.rows:
                if time.monotonic() > deadline:
                    report["results"].append({"model": model, "layer": layer, "rows": rows, "skipped": "time budget"})
                    continue
                entry = measure(model, layer, out_features, in_features, rows, rows in args.sweep_rows)
                report["results"].append(entry)
                print(json.dumps(entry), flush=True)
                path.write_text(json.dumps(report, indent=2))
    path.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
