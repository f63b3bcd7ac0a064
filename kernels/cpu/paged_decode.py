"""The CPU decode-attention kernel (paged_decode.cpp), built once per machine with the C++ compiler torch uses.

The build (tens of seconds, then cached under TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions) needs g++ and ninja;
without them `load()` raises and the backend falls back to the torch reference.
"""

import functools
import hashlib
import os
import platform
from pathlib import Path

import torch

from strata.kernels.metadata import LayerKV

SOURCE = Path(__file__).with_name("paged_decode.cpp")


def load():
    """The compiled module; raises (RuntimeError, OSError, ...) when it cannot be built here."""
    module, error = _build()
    if error is not None:
        raise error
    return module


@functools.cache
def _build():
    """Built (or found built) once per process; a failure is remembered too, not retried on every engine start."""
    from torch.utils.cpp_extension import load as build

    os.environ.setdefault("MAX_JOBS", "2")
    try:
        return build(f"strata_cpu_paged_decode_{cpu_fingerprint()}", [str(SOURCE)],
                     extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"], extra_ldflags=["-fopenmp"],
                     verbose=False), None
    except Exception as exc:
        return None, exc


def cpu_fingerprint() -> str:
    """A short hash of this CPU's model and instruction-set flags: the build uses -march=native, so a cache directory
    shared by different CPUs (a mounted home, a container image) must not hand one CPU's build to another."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = [platform.machine(), platform.processor()]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:10]


def paged_decode_attention(q: torch.Tensor, kv: LayerKV, block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """One query token per sequence: q [B, Hq, D] -> [B, Hq, D], fp32 math whatever the cache holds."""
    empty = q.new_empty(0, dtype=torch.float16)
    out = load().paged_decode((q.float() * scale).contiguous(), kv.k, kv.v,
                              kv.k_scale if kv.quantized else empty, kv.v_scale if kv.quantized else empty,
                              block_tables.to(torch.int32).contiguous(), context_lens.to(torch.int32).contiguous())
    return out.to(q.dtype)
