"""Time one layer's decode attention alone: the C++ kernel (backend `cpu`) against the torch reference.

64 sequences of 20-560 cached tokens in blocks scattered over a 30-layer bf16 pool shaped like SmolLM2-135M's
(9 query heads, 3 KV heads, head_dim 64), at 1 and 2 threads. Prints JSON; GB/s counts the K and V bytes read once.

    .venv/bin/python benchmarks/decode_attention.py [--out benchmarks/results/decode_attention_cpu_bf16.json]
"""

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from strata.kernels import torch_reference
from strata.kernels.cpu import paged_decode as cpu_paged
from strata.kernels.metadata import LayerKV


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.manual_seed(0)
    num_blocks, block_size, kv_heads, head_dim, heads, layers, batch = 2300, 16, 3, 64, 9, 30, 64
    pool = torch.randn(num_blocks, layers, 2, kv_heads, block_size, head_dim).to(torch.bfloat16)  # head-major blocks
    kv = LayerKV(pool[:, 5, 0].permute(0, 2, 1, 3), pool[:, 5, 1].permute(0, 2, 1, 3))
    lens = torch.randint(20, 560, (batch,), dtype=torch.int32)
    tables = torch.randperm(num_blocks)[:batch * 35].view(batch, 35).to(torch.int32)
    q = torch.randn(batch, heads, head_dim).to(torch.bfloat16)
    cpu_paged.load()
    results = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for name, attend in (("cpu", cpu_paged.paged_decode_attention),
                             ("torch", torch_reference.paged_decode_attention)):
            for _ in range(3):
                attend(q, kv, tables, lens, 0.125)
            start = time.perf_counter()
            for _ in range(args.repeats):
                attend(q, kv, tables, lens, 0.125)
            seconds = (time.perf_counter() - start) / args.repeats
            read = int(lens.sum()) * kv_heads * head_dim * 2 * 2
            results.append({"backend": name, "threads": threads, "ms": round(seconds * 1e3, 3),
                            "gb_s": round(read / seconds / 1e9, 2)})
    report = {"benchmark": "decode_attention", "batch": batch, "context_tokens": int(lens.sum()),
              "kv_dtype": "bf16", "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
              "results": results}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
