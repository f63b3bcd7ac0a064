"""How long a fresh build of the C++ CPU kernels takes (what CI and a user's first `strata serve` pay), and, in the
same run, what one source pays for each header it could include: torch/extension.h against ATen's core headers,
which is why only kernels/cpu/bindings.cpp includes the former.

    .venv/bin/python benchmarks/cpu_kernel_build.py --out benchmarks/results/cpu_kernel_build.json \
        [--also /path/to/a/checkout/of/another/commit]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from torch.utils import cpp_extension

from strata.server.bench.kv import cpu_isa, machine_note

HEADERS = ("torch/extension.h", "ATen/core/Tensor.h", "ATen/Parallel.h")
BUILD = "from strata.kernels.cpu import build; build.build_kernels()"


def header_seconds(header: str, folder: Path) -> float:
    """Compile a source that includes only `header`, with the flags the kernels are built with."""
    source = folder / "probe.cpp"
    source.write_text(f"#include <{header}>\n")
    includes = [f"-isystem{path}" for path in (*cpp_extension.include_paths(), sysconfig.get_paths()["include"])]
    start = time.perf_counter()
    subprocess.run(["c++", *includes, "-fPIC", "-std=c++20", "-O3", "-march=native",
                    "-c", str(source), "-o", str(folder / "probe.o")], check=True)
    return round(time.perf_counter() - start, 1)


def fresh_build_seconds(checkout: Path | None = None) -> float:
    """Build this checkout's kernels (or another checkout's: the repository root is the package `strata`) into an
    empty extensions folder, in a process of their own."""
    with tempfile.TemporaryDirectory() as folder:
        env = {**os.environ, "TORCH_EXTENSIONS_DIR": folder}
        if checkout is not None:
            (Path(folder) / "strata").symlink_to(checkout.resolve())
            env["PYTHONPATH"] = folder
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", BUILD], env=env, check=True, cwd=folder)
        return round(time.perf_counter() - start, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    ap.add_argument("--also", type=Path, help="a checkout of another commit whose kernels to build too, for a ratio")
    args = ap.parse_args()
    load_at_start = os.getloadavg()
    result = {"fresh_build_s": fresh_build_seconds()}
    if args.also:
        commit = subprocess.run(["git", "-C", str(args.also), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        result["other_checkout"] = {"commit": commit, "fresh_build_s": fresh_build_seconds(args.also)}
    with tempfile.TemporaryDirectory() as folder:
        headers = {header: header_seconds(header, Path(folder)) for header in HEADERS}
    result |= {"one_source_including_only_s": headers,
              "max_jobs": os.environ.get("MAX_JOBS", "2"), "cpu_isa": cpu_isa(),
              "machine_note": machine_note(load_at_start)}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
