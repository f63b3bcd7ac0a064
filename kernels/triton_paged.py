"""Helpers shared by the Triton paged-attention kernels: gathering K/V tiles through a block table."""

import torch
import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)  # softmax runs in base 2 (exp2 is one instruction on GPUs); scores are pre-scaled by this


@triton.jit
def load_kv_tile(cache, scales, table, positions, valid, kv_head, offs_d, d_mask,
                 stride_b, stride_t, stride_h, scale_stride_b, scale_stride_t, scale_stride_h,
                 BLOCK_SIZE: tl.constexpr, QUANTIZED: tl.constexpr):
    """K or V of `positions` ([N]) of one sequence, read through its block-table row, as fp32 [N, BLOCK_D].

    INT8 rows are multiplied by their per-(token, kv-head) scale in registers; invalid positions read as 0.
    """
    block_ids = tl.load(table + positions // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)  # int64: blocks span GBs
    offsets = positions % BLOCK_SIZE
    rows = cache + block_ids * stride_b + offsets * stride_t + kv_head * stride_h
    x = tl.load(rows[:, None] + offs_d[None, :], mask=valid[:, None] & d_mask[None, :], other=0).to(tl.float32)
    if QUANTIZED:
        s = tl.load(scales + block_ids * scale_stride_b + offsets * scale_stride_t + kv_head * scale_stride_h,
                    mask=valid, other=0.0)
        x = x * s[:, None]
    return x


def dot_precision(q: torch.Tensor, cache: torch.Tensor) -> str:
    """fp32 models need exact fp32 dots; bf16/fp16/INT8 values are exact in tf32, so tensor cores lose nothing."""
    return "ieee" if torch.float32 in (q.dtype, cache.dtype) else "tf32"


def head_block(head_dim: int) -> int:
    """Power-of-two tile width covering head_dim (at least 16, the smallest tl.dot dimension)."""
    return max(16, triton.next_power_of_2(head_dim))


def scale_args(scales: torch.Tensor | None) -> tuple[torch.Tensor | None, int, int, int]:
    """(pointer, strides) of an INT8 scale view, or (None, 0, 0, 0) for a float cache."""
    return (scales, *scales.stride()) if scales is not None else (None, 0, 0, 0)
