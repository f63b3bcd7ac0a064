"""Triton W8A16 / W4A16 linear layers on CUDA: activations times GGUF Q8_0 or Q4_0/Q4_1 weights widened in registers.

Decode reads every weight once per token, so on a GPU as on a CPU its speed follows the bytes per weight: bf16 2,
Q8_0 1.06, Q4_x 0.56-0.63. The blocks keep the layout of models/compact_linear.py (codes [N, K] int8, or [N, K / 2]
uint8 with GGUF's nibble order; one fp32 scale, and for Q4 one minimum, per 32 columns), so one loaded model runs on
either kernel. Each tile is widened to the activations' dtype and multiplied on tensor cores with fp32 accumulation.
"""

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

GROUP = 32
FORMATS = {"q8": 1, "q4": 2}
# The CPU interpreter multiplies bf16 tiles wrongly (numpy has no bf16): there the same rounded values go through an
# fp32 dot.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _weight_linear_kernel(
    x, w, scales, mins, out, M, N, K,
    stride_xm, stride_wn, stride_sn, stride_om,
    FORMAT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, WIDE_DOT: tl.constexpr,
):
    """Grid (N tiles, M tiles): one [BLOCK_M, BLOCK_N] output tile, the K loop widening one weight tile per step."""
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    w_rows = offs_n.to(tl.int64)[:, None] * stride_wn        # int64: an 8B model's lm_head spans > 2 GB at Q8_0
    s_rows = offs_n.to(tl.int64)[:, None] * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        a = tl.load(x + offs_m[:, None] * stride_xm + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        mask = n_mask[:, None] & k_mask[None, :]
        group = (k // 32)[None, :]
        if FORMAT == 1:
            codes = tl.load(w + w_rows + k[None, :], mask=mask, other=0).to(tl.float32)
        else:
            # A Q4 block's 16 bytes hold columns 0-15 in their low nibbles and 16-31 in their high ones (GGUF order).
            byte = tl.load(w + w_rows + group * 16 + (k % 16)[None, :], mask=mask, other=0).to(tl.int32)
            codes = ((byte >> ((k % 32) // 16 * 4)[None, :]) & 15).to(tl.float32)
        weight = codes * tl.load(scales + s_rows + group, mask=mask, other=0.0)
        if FORMAT == 2:
            weight += tl.load(mins + s_rows + group, mask=mask, other=0.0)
        weight = weight.to(a.dtype)              # what tensor cores multiply: the widened weight in the activations' dtype
        if WIDE_DOT:
            acc += tl.dot(a.to(tl.float32), tl.trans(weight.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(weight), input_precision=PRECISION)
    tl.store(out + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@dataclass(frozen=True, slots=True)
class TileConfig:
    """Tile sizes and launch settings of one call; block_k is a multiple of the 32-column group."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def pick_config(rows: int) -> TileConfig:
    """Decode (few rows) is bandwidth-bound: narrow N tiles give every SM weight rows to stream; prefill is
    compute-bound: wide tiles reuse each widened weight tile across many rows."""
    if rows <= 16:
        return TileConfig(16, 32, 128, num_warps=4, num_stages=4)
    if rows <= 64:
        return TileConfig(64, 64, 64, num_warps=4, num_stages=3)
    return TileConfig(128, 128, 64, num_warps=8, num_stages=3)


def linear(x: torch.Tensor, format: str, weight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
           in_features: int, config: TileConfig | None = None) -> torch.Tensor:
    """x [..., K] times the Q8_0 / Q4 weight [N, K] transposed -> [..., N] in x's dtype (fp32 accumulation)."""
    if format not in FORMATS:
        raise ValueError(f"the Triton weight kernel runs {', '.join(FORMATS)} blocks, not {format!r}")
    rows = x.reshape(-1, in_features)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    num_rows, num_out = rows.shape[0], weight.shape[0]
    out = torch.empty(num_rows, num_out, dtype=x.dtype, device=x.device)
    config = config or pick_config(num_rows)
    grid = (triton.cdiv(num_out, config.block_n), triton.cdiv(num_rows, config.block_m))
    _weight_linear_kernel[grid](
        rows, weight, scales, mins if mins is not None else scales, out, num_rows, num_out, in_features,
        rows.stride(0), weight.stride(0), scales.stride(0), out.stride(0),
        FORMAT=FORMATS[format], BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", WIDE_DOT=INTERPRETED,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out.view(*x.shape[:-1], num_out)
