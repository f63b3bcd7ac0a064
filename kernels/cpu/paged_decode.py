"""The CPU decode-attention kernel (paged_decode.cpp), built once per machine (cpu/build.py); when it cannot be built
`load()` raises and the backend falls back to the torch reference."""

import functools
from pathlib import Path

import torch

from strata.kernels.cpu.build import build_extension
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
    try:
        return build_extension("paged_decode", SOURCE), None
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
