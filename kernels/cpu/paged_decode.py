"""The CPU decode-attention kernel (paged_decode.cpp), built once per machine with the others (cpu/build.py); when
it cannot be built `load()` raises and the backend falls back to the torch reference."""

import torch

from strata.kernels import torch_reference
from strata.kernels.cpu.build import build_kernels
from strata.kernels.metadata import LayerKV


def load():
    """The compiled module; raises (RuntimeError, OSError, ...) when it cannot be built here."""
    return build_kernels()


def write_kv(key: torch.Tensor, value: torch.Tensor, kv: LayerKV, slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V ([T, H, D]) into their slots: one C++ call for a float cache; INT8 quantizes in torch."""
    if kv.quantized:
        torch_reference.write_kv(key, value, kv, slot_mapping)
    else:
        load().write_kv_(key.float(), value.float(), kv.k, kv.v, slot_mapping)


def paged_decode_attention(q: torch.Tensor, kv: LayerKV, block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """One query token per sequence: q [B, Hq, D] -> [B, Hq, D], fp32 math whatever the cache holds."""
    empty = q.new_empty(0, dtype=torch.float16)
    out = load().paged_decode((q.float() * scale).contiguous(), kv.k, kv.v,
                              kv.k_scale if kv.quantized else empty, kv.v_scale if kv.quantized else empty,
                              block_tables.to(torch.int32).contiguous(), context_lens.to(torch.int32).contiguous())
    return out.to(q.dtype)
