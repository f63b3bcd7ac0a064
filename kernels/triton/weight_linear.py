"""Triton W8A16 / W4A16 linear layers on CUDA: activations times GGUF Q8_0 or Q4_0/Q4_1 weights widened in registers.

Decode reads every weight once per token, so on a GPU as on a CPU its speed follows the bytes per weight: bf16 2,
Q8_0 1.06, Q4_x 0.56-0.63. The blocks keep the layout of models/compact_linear.py (codes [N, K] int8, or [N, K / 2]
uint8 with GGUF's nibble order; one fp32 scale, and for Q4 one minimum, per 32 columns), so one loaded model runs on
either kernel. Each tile is widened to the activations' dtype and multiplied on tensor cores with fp32 accumulation.
"""

import functools
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
    x, w, scales, mins, out, M, N, K, k_per_split,
    stride_xm, stride_wn, stride_sn, stride_os, stride_om,
    FORMAT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, WIDE_DOT: tl.constexpr,
):
    """Grid (N tiles, M tiles, K splits): one [BLOCK_M, BLOCK_N] output tile over k_per_split columns, the K loop
    widening one weight tile per step; with several splits each writes an fp32 partial (out[split]), summed after.

    Scales (and minimums) are read once per 32-column group and broadcast in registers. A Q4 tile is read as its
    bytes, whose two nibbles hold columns j and j + 16 of a group (GGUF order): the widened tile keeps that
    interleaved order and the activations are read in the same order, which leaves every dot product unchanged.
    """
    GROUPS: tl.constexpr = BLOCK_K // 32
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    w_rows = offs_n.to(tl.int64)[:, None] * stride_wn        # int64: an 8B model's lm_head spans > 2 GB at Q8_0
    s_rows = offs_n.to(tl.int64)[:, None] * stride_sn
    lane = tl.arange(0, BLOCK_K)
    if FORMAT == 1:
        columns = lane
    else:
        columns = lane // 32 * 32 + lane % 32 // 2 + lane % 2 * 16
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = tl.program_id(2) * k_per_split
    for k0 in range(k_start, min(K, k_start + k_per_split), BLOCK_K):
        group = k0 // 32 + tl.arange(0, GROUPS)
        g_mask = n_mask[:, None] & (group < K // 32)[None, :]
        scale = tl.load(scales + s_rows + group[None, :], mask=g_mask, other=0.0)[:, :, None]
        if FORMAT == 1:
            k = k0 + lane
            codes = tl.load(w + w_rows + k[None, :], mask=n_mask[:, None] & (k < K)[None, :], other=0)
            weight = tl.reshape(codes.to(tl.float32), [BLOCK_N, GROUPS, 32]) * scale
        else:
            byte = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            packed = tl.load(w + w_rows + byte[None, :], mask=n_mask[:, None] & (byte < K // 2)[None, :], other=0)
            codes = tl.reshape(tl.join(packed & 15, packed >> 4), [BLOCK_N, GROUPS, 32])
            minimum = tl.load(mins + s_rows + group[None, :], mask=g_mask, other=0.0)[:, :, None]
            weight = codes.to(tl.float32) * scale + minimum
        k = k0 + columns
        a = tl.load(x + offs_m[:, None] * stride_xm + k[None, :], mask=m_mask[:, None] & (k < K)[None, :], other=0.0)
        weight = tl.reshape(weight, [BLOCK_N, BLOCK_K]).to(a.dtype)  # what tensor cores multiply: the activations' dtype
        if WIDE_DOT:
            acc += tl.dot(a.to(tl.float32), tl.trans(weight.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(weight), input_precision=PRECISION)
    tl.store(out + tl.program_id(2) * stride_os + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@dataclass(frozen=True, slots=True)
class TileConfig:
    """Tile sizes and launch settings of one call; block_k is a multiple of the 32-column group; split_k None picks
    the number of K splits from the GPU's size."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int | None = None


def pick_config(rows: int) -> TileConfig:
    """Decode (few rows) is bandwidth-bound: narrow N tiles (and K splits) give every SM weight rows to stream;
    prefill is compute-bound: wide tiles reuse each widened weight tile across many rows."""
    if rows <= 16:
        return TileConfig(16, 32, 128, num_warps=4, num_stages=4)
    if rows <= 64:
        return TileConfig(64, 64, 64, num_warps=4, num_stages=3)
    return TileConfig(128, 128, 64, num_warps=8, num_stages=3, split_k=1)


@functools.cache
def multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def k_splits(config: TileConfig, tiles: int, in_features: int, device: torch.device) -> int:
    """Enough programs to fill the GPU twice over: a 2048-wide layer at 32 columns per tile is 64 programs, half an
    H200's 132 multiprocessors, unless its K loop is split."""
    if config.split_k is not None:
        return config.split_k
    steps = triton.cdiv(in_features, config.block_k)
    return max(1, min(steps // 2, triton.cdiv(2 * multiprocessors(device), tiles)))


def linear(x: torch.Tensor, format: str, weight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
           in_features: int, config: TileConfig | None = None) -> torch.Tensor:
    """x [..., K] times the Q8_0 / Q4 weight [N, K] transposed -> [..., N] in x's dtype (fp32 accumulation)."""
    if format not in FORMATS:
        raise ValueError(f"the Triton weight kernel runs {', '.join(FORMATS)} blocks, not {format!r}")
    rows = x.reshape(-1, in_features)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    num_rows, num_out = rows.shape[0], weight.shape[0]
    config = config or pick_config(num_rows)
    tiles = (triton.cdiv(num_out, config.block_n), triton.cdiv(num_rows, config.block_m))
    splits = k_splits(config, tiles[0] * tiles[1], in_features, x.device)
    k_per_split = triton.cdiv(triton.cdiv(in_features, splits), config.block_k) * config.block_k
    splits = triton.cdiv(in_features, k_per_split)
    out = torch.empty(splits, num_rows, num_out, dtype=x.dtype if splits == 1 else torch.float32, device=x.device)
    _weight_linear_kernel[(*tiles, splits)](
        rows, weight, scales, mins if mins is not None else scales, out, num_rows, num_out, in_features, k_per_split,
        rows.stride(0), weight.stride(0), scales.stride(0), out.stride(0), out.stride(1),
        FORMAT=FORMATS[format], BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", WIDE_DOT=INTERPRETED,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    out = out[0] if splits == 1 else out.sum(0).to(x.dtype)
    return out.view(*x.shape[:-1], num_out)
