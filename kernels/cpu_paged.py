"""The CPU decode-attention kernel (cpu_paged_decode.cpp), built once per machine with the C++ compiler torch uses.

The build (~1 min, then cached under TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions) needs g++; without one,
`load()` raises and the backend falls back to the torch reference.
"""

import functools
import os
from pathlib import Path

import torch

from strata.kernels.metadata import LayerKV

SOURCE = Path(__file__).with_name("cpu_paged_decode.cpp")


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
        return build("strata_cpu_paged_decode", [str(SOURCE)], extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
                     extra_ldflags=["-fopenmp"], verbose=False), None
    except Exception as exc:
        return None, exc


def paged_decode_attention(q: torch.Tensor, kv: LayerKV, block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """One query token per sequence: q [B, Hq, D] -> [B, Hq, D], fp32 math whatever the cache holds."""
    empty = q.new_empty(0, dtype=torch.float16)
    out = load().paged_decode((q.float() * scale).contiguous(), kv.k, kv.v,
                              kv.k_scale if kv.quantized else empty, kv.v_scale if kv.quantized else empty,
                              block_tables.to(torch.int32).contiguous(), context_lens.to(torch.int32).contiguous())
    return out.to(q.dtype)
